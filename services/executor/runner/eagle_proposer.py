"""Speculative decoding's `eagle3` method: an EAGLE-3 head (services/executor/models/eagle3.py)
guesses each request's next tokens from the target's hidden states, on the device right after
each step (services/executor/runner/step_proposer.py: what it shares with a draft model).

Every step of the target writes the residual streams entering three of its layers into one
buffer. The head's catch-up reads, at every position the step computed, its `fc` of the
target's states there and the token after the position (the next input token of the row, or
where the position was sampled, the sampled token). Its first draft comes from the catch-up at
each speculating row's drafting position; each further draft from one more pass at the next
position, reading the draft before it and the head's own stream (EAGLE's stand-in for the
target's state there). A shared prefix block's last position read the next token of the
request that computed it; another request's next token may differ, which costs acceptance, not
exactness.

It runs whole on the first rank (with tensor parallelism, beside the target's part there: the
target's hidden states are whole on every rank, and the head reads a whole copy of the
target's embedding, gathered from the ranks at load).
"""

from __future__ import annotations

import logging

import torch

from kernels import ops
from services.executor.layers.attention_metadata import AttentionMetadata
from services.executor.loading.loader import load_eagle3_head
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.runner.kv_cache import KVCacheLayout
from services.executor.runner.step_buffers import StepView
from services.executor.runner.step_proposer import StagedRows, StepProposer
from shared.config import Config
from shared.model_config import resolve_model_source
from shared.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


class EagleProposer(StepProposer):
    NAME = "the EAGLE-3 head"

    def __init__(
        self,
        config: Config,
        spec: SpeculativeConfig,
        target: DecoderForCausalLM,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        target_embedding: torch.nn.Module | None = None,
    ) -> None:
        """`target_embedding`: the target's embedding whole, where the target holds one
        rank's rows of it (tensor parallelism); None: the target's own."""
        source = resolve_model_source(spec.draft_model)
        self.head = load_eagle3_head(
            source, target, config.load_format, dtype, max_model_len, config.seed, target_embedding
        )
        # Before the KV cache is sized and graphs are captured: both must see the buffer.
        self.aux_hidden = target.capture_aux_hidden(
            self.head.config.aux_layer_ids, config.max_num_batched_tokens
        )
        layout = KVCacheLayout.of(self.head.config.layer, config.block_size, dtype)
        super().__init__(config, spec.num_speculative_tokens, max_model_len, layout, device)
        # The token after each position, and by row the streams a further pass reads (the
        # last pass's are read by none).
        hidden = self.head.config.layer.hidden_size
        rows, tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.next_ids = torch.zeros(tokens, dtype=torch.int32, device=device)
        self.streams = torch.zeros(self.num_drafts - 1, rows, hidden, dtype=dtype, device=device)

    def _stage_tokens(
        self, view: StepView, sampled: torch.Tensor | None, num_tokens: int, staged: StagedRows
    ) -> None:
        """The token after each position of the step: the row's next input token, the sample
        where the position sampled, or the known token after a prompt chunk."""
        next_ids = self.next_ids
        ops.next_token_ids(view.input_ids, view.sample_rows, sampled, next_ids, num_tokens)
        if staged.chunk_ends.numel():
            next_ids[staged.chunk_ends] = staged.chunk_next.to(next_ids.dtype)

    def _catch_up_forward(self, view: StepView) -> torch.Tensor:
        """The head at each position of the step, then its drafts: at each row's drafting
        position (`_drafting_rows`) the first, and each further one from a pass of its own,
        into ids and streams. Returns the streams of the positions [T, hidden]."""
        num_tokens = view.input_ids.shape[0]
        hidden = self.head.project(self.aux_hidden[:num_tokens])
        normed, stream = self.head(
            self.next_ids[:num_tokens], view.positions, hidden, self.kv_caches[0], view.meta
        )
        drafting, at, last = self._drafting_rows(view)
        num_rows = at.shape[0]
        self.head.draft_ids(torch.index_select(normed, 0, at), out=self.ids[0, :num_rows])
        if self.num_drafts > 1:
            torch.index_select(stream, 0, at, out=self.streams[0, :num_rows])
        for j in range(1, self.num_drafts):
            self._draft_pass(view.meta, last, drafting, j)
        return stream

    def _draft_pass(
        self, meta: AttentionMetadata, last: torch.Tensor, drafting: torch.Tensor, j: int
    ) -> None:
        """Draft j + 1 of each drafting row, at its drafting position `last` + j: the head
        reads draft j and its own stream before it (ids[j - 1], streams[j - 1]) and writes
        ids[j], and streams[j] where a pass follows."""
        num = last.shape[0]
        pass_meta, at = self._pass_meta(meta, last, drafting, j)
        before = self.ids[j - 1, :num], self.streams[j - 1, :num]
        normed, stream = self.head(before[0], at, before[1], self.kv_caches[0], pass_meta)
        self.head.draft_ids(normed, out=self.ids[j, :num])
        if j + 1 < self.num_drafts:
            self.streams[j, :num] = stream
