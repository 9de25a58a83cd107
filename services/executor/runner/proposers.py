"""Which proposer of speculative decoding a runner holds, and what it costs and needs of the
runner: KV blocks of its own (a draft model, an EAGLE-3 head) and the target's hidden states
(EAGLE-3)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from services.executor.models.decoder import DecoderForCausalLM
from services.executor.parallel.tensor_parallel import TensorParallel
from services.executor.runner.draft_proposer import DraftProposer, HasBlocks
from services.executor.runner.eagle_proposer import EagleProposer
from services.executor.speculative import (
    HiddenStateProposer,
    Proposer,
    make_proposer,
    reads_hidden_states,
)
from shared.config import Config
from shared.model_config import ModelConfig
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
) -> Proposer | HiddenStateProposer | None:
    """The runner's proposer: none without speculation; a draft model's or an EAGLE-3 head's
    on the first rank only (the others propose nothing: collect reads rank 0's drafts)."""
    if spec is None or spec.method not in ("draft_model", "eagle3"):
        return make_proposer(spec)
    if spec.method == "eagle3" and runner.tp.size > 1:
        raise ValueError("eagle3 runs with --tensor-parallel-size 1 (with more: not built yet)")
    if runner.tp.rank != 0:
        return None
    limits = (runner.max_model_len, runner.dtype, runner.device)
    if spec.method == "draft_model":
        return DraftProposer(config, spec, runner.model_config, *limits)
    return EagleProposer(config, spec, runner.model, *limits)


def bytes_per_block(proposer: object) -> int:
    """What a KV block costs the proposer besides the target (none without a model)."""
    if isinstance(proposer, DraftProposer | EagleProposer):
        return proposer.layout.bytes_per_block
    return 0


def allocate_kv_cache(proposer: object, num_blocks: int, requests: Mapping[str, HasBlocks]) -> None:
    """A draft model's or head's KV cache (nothing for the other proposers)."""
    if isinstance(proposer, DraftProposer | EagleProposer):
        proposer.allocate(num_blocks, requests)


def step_hidden(proposer: object, num_tokens: int) -> torch.Tensor | None:
    """Right after a step's forward pass: what the proposer keeps of its hidden states."""
    if reads_hidden_states(proposer):
        return proposer.project(num_tokens)
    return None
