"""Speculative decoding's `draft_model` method: a smaller model of the same tokenizer guesses each
request's next tokens, greedily, on the device right after each step of the target
(services/executor/runner/step_proposer.py: what it shares with an EAGLE-3 head).

The draft has a KV cache of its own, in the target's block shape and on the same block ids:
a request's block-table row serves both models, and the scheduler's accounting covers both (it
sizes the pool for their bytes together, and reserves the slots past a request's tokens that
the next proposal writes: SchedulerConfig.num_lookahead_tokens). Its catch-up is the draft
model's forward pass over the step's own tokens, which writes its KV where the target wrote
the target's. Its first draft needs a pass of its own: the draft reads the token at a position,
and the token after a row's drafting position is the step's sample there. So each speculating
row gets k passes of one token after the catch-up: the sample, then each draft in turn.

It runs on the first rank only, whole (draft_tensor_parallel_size 1). On a GPU the catch-up
and the passes replay one CUDA graph per step shape of the target's: the draft's eager passes
cost its kernels' launches from Python, some 25 ms a pass for SmolLM2-135M's 30 layers on an
H100 (2026-12-05).
"""

from __future__ import annotations

import logging

import torch

from kernels import ops
from services.executor.layers.attention_metadata import AttentionMetadata
from services.executor.loading.loader import load_model
from services.executor.runner.kv_cache import KVCacheLayout
from services.executor.runner.step_buffers import StepView
from services.executor.runner.step_proposer import StagedRows, StepProposer
from shared.config import Config
from shared.model_config import ModelConfig, load_model_config, resolve_model_source
from shared.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


class DraftProposer(StepProposer):
    WRITES_AHEAD = 1
    NAME = "the draft model"

    def __init__(
        self,
        config: Config,
        spec: SpeculativeConfig,
        target: ModelConfig,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        source = resolve_model_source(spec.draft_model)
        self.model_config = load_model_config(source)
        if self.model_config.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({self.model_config.vocab_size} tokens) is not "
                f"the target's ({target.vocab_size}): it must share the target's tokenizer"
            )
        self.model = load_model(
            source,
            self.model_config,
            config.load_format,
            dtype,
            device,
            max_position=max_model_len,
            seed=config.seed,
            quantization=spec.draft_quantization,
        )
        layout = KVCacheLayout.of(self.model_config, config.block_size, dtype)
        super().__init__(config, spec.num_speculative_tokens, max_model_len, layout, device)
        # Each row's sample at its drafting position: the first pass's input.
        self.first_ids = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=device)
        logger.info(
            "draft model %s: %d layers, %d drafts a step",
            source.name,
            self.model_config.num_layers,
            self.num_drafts,
        )

    def _stage_tokens(
        self, view: StepView, sampled: torch.Tensor | None, num_tokens: int, staged: StagedRows
    ) -> None:
        """Each row's sample at its drafting position (none without samples on the device:
        then no row drafts)."""
        if sampled is None or not sampled.shape[0]:
            self._draft_none()
            return
        at = staged.first_sample + staged.accepted
        rows = at.shape[0]
        self.first_ids[:rows] = sampled[at.clamp(max=sampled.shape[0] - 1)]

    def _catch_up_forward(self, view: StepView) -> torch.Tensor:
        """The draft at each position of the step (its KV), then k passes of one token a
        drafting row into ids. Returns the hidden states of the positions [T, hidden]."""
        hidden = self.model(view.input_ids, view.positions, self.kv_caches, view.meta)
        drafting, _, last = self._drafting_rows(view)
        for j in range(1, self.num_drafts + 1):
            self._draft_pass(view.meta, last, drafting, j)
        return hidden

    def _draft_pass(
        self, meta: AttentionMetadata, last: torch.Tensor, drafting: torch.Tensor, j: int
    ) -> None:
        """Draft j of each drafting row, from its token at `last` + j: the sample there (j =
        1) or draft j - 1 (ids[j - 2]), into ids[j - 1]."""
        num = last.shape[0]
        pass_meta, at = self._pass_meta(meta, last, drafting, j)
        before = self.first_ids[:num] if j == 1 else self.ids[j - 2, :num]
        hidden = self.model(before, at, self.kv_caches, pass_meta)
        ops.argmax(self.model.compute_logits(hidden), out=self.ids[j - 1, :num])
