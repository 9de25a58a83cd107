"""Which proposer of speculative decoding a runner holds, and what it costs and needs of the
runner: KV blocks of its own (a draft model, an EAGLE-3 head) and the target's hidden states
(EAGLE-3)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from services.executor.layers.embedding import VocabParallelEmbedding
from services.executor.loading.loader import eagle3_head_has_embedding
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.parallel.layout import ShardLayout
from services.executor.parallel.tensor_parallel import ONE_RANK, TensorParallel
from services.executor.runner.draft_proposer import DraftProposer
from services.executor.runner.eagle_proposer import EagleProposer
from services.executor.runner.step_buffers import StepView
from services.executor.runner.step_proposer import StepProposer
from services.executor.runner.step_state import PreparedStep
from services.executor.speculative import (
    DeviceProposer,
    PendingDrafts,
    Proposer,
    SpeculatingRequest,
    make_proposer,
)
from shared.config import Config
from shared.model_config import ModelConfig, resolve_model_source
from shared.speculative import SpeculativeConfig


class Runner(Protocol):
    """What proposer_for reads of the model runner."""

    model: DecoderForCausalLM
    model_config: ModelConfig
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    tp: TensorParallel


def proposer_for(
    spec: SpeculativeConfig | None, config: Config, runner: Runner
) -> Proposer | DeviceProposer | None:
    """The runner's proposer: none without speculation; a draft model's or an EAGLE-3 head's
    on the first rank only (the others propose nothing: collect reads rank 0's drafts, which
    the plans relay to them)."""
    if spec is not None and runner.model.long_rope is not None:
        # A verifying row could cross LongRoPE's original context mid-step, which the
        # scheduler's recompute at the crossing (services/scheduler/scheduler.py) cannot do.
        raise ValueError("speculative decoding is not supported for LongRoPE models (Phi-3)")
    if spec is None or spec.method not in ("draft_model", "eagle3"):
        return make_proposer(spec)
    embedding = None
    if spec.method == "eagle3" and runner.tp.size > 1:  # every rank takes part
        embedding = _whole_target_embedding(spec, config, runner)
    if runner.tp.rank != 0:
        return None
    limits = (runner.max_model_len, runner.dtype, runner.device)
    if spec.method == "draft_model":
        return DraftProposer(config, spec, runner.model_config, *limits)
    return EagleProposer(config, spec, runner.model, *limits, embedding)


def _whole_target_embedding(
    spec: SpeculativeConfig, config: Config, runner: Runner
) -> VocabParallelEmbedding | None:
    """On the first rank, the target's embedding whole, gathered from every rank's rows, for
    an EAGLE-3 head that reads the target's (None on the others, and for a head with its own
    embedding). A collective: every rank calls it. The copy costs the first rank the
    embedding's memory again, before its KV cache is sized."""
    source = resolve_model_source(spec.draft_model)
    tp = runner.tp
    reads_target = tp.rank == 0 and not eagle3_head_has_embedding(source, config.load_format)
    if not tp.first_rank_value(int(reads_target), runner.device):
        return None
    rows = tp.gather_rows(runner.model.embed_tokens.weight.detach())
    if tp.rank != 0:
        return None
    with torch.device("meta"):  # its weight is the gathered one
        whole = VocabParallelEmbedding(ShardLayout.of(runner.model_config, ONE_RANK), rows.shape[1])
    whole.weight = torch.nn.Parameter(rows, requires_grad=False)
    return whole


def bytes_per_block(proposer: object) -> int:
    """What a KV block costs the proposer besides the target (none without a model)."""
    if isinstance(proposer, StepProposer):
        return proposer.layout.bytes_per_block
    return 0


def allocate_kv_cache(proposer: object, num_blocks: int) -> None:
    """A draft model's or head's KV cache (nothing for the other proposers)."""
    if isinstance(proposer, StepProposer):
        proposer.allocate(num_blocks)


def after_step(
    proposer: object,
    prepared: PreparedStep,
    view: StepView,
    sampled: torch.Tensor | None,
    requests: Mapping[str, SpeculatingRequest],
) -> PendingDrafts | None:
    """A draft model's or EAGLE-3 head's catch-up and drafts of a launched step, queued after
    its sampling and outside its device span (the proposer's work, which the step's tokens
    need not wait for), before the next forward pass overwrites the target's hidden states;
    None for the other proposers."""
    if isinstance(proposer, StepProposer):
        return proposer.after_step(prepared, view, sampled, requests)
    return None
