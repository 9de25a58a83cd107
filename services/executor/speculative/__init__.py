"""Proposers of speculative decoding: each guesses a request's next tokens (its drafts), which
the next step verifies with the target model (shared/speculative.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol, TypeGuard

import torch

from services.executor.speculative.ngram import NgramProposer
from services.executor.speculative.suffix import SuffixProposer
from shared.speculative import SpeculativeConfig


class Proposer(Protocol):
    def propose_batch(self, requests: Iterable[tuple[str, list[int]]]) -> dict[str, list[int]]:
        """Drafts for each (request id, its tokens so far), leaving out those without any."""
        ...

    def finished(self, request_id: str, output_token_ids: list[int]) -> None:
        """A request ended (or was preempted) with this output."""
        ...

    def reset(self) -> None:
        """Every request is gone (the runner's reset), with no `finished` for each."""
        ...


class RowSpan(NamedTuple):
    """A row of a step: its request, token index of its first token in the step, first
    position, number of tokens."""

    request_id: str
    first: int
    start: int
    count: int


class SpeculatingRequest(Protocol):
    token_ids: list[int]  # prompt and output so far
    block_ids: list[int]  # its block-table row
    speculates: bool


class HiddenStateProposer(Protocol):
    """A proposer that reads the target's hidden states (EAGLE-3): fed every step's rows."""

    def project(self, num_tokens: int) -> torch.Tensor:
        """Right after a step's forward pass: what the proposer keeps of its hidden states."""
        ...

    def propose_step(
        self,
        spans: Sequence[RowSpan],
        hidden: torch.Tensor,
        wanted: set[str],
        requests: Mapping[str, SpeculatingRequest],
    ) -> dict[str, list[int]]:
        """Once the step's tokens are known: drafts for the `wanted` requests."""
        ...

    def finished(self, request_id: str, output_token_ids: list[int]) -> None: ...

    def reset(self) -> None: ...


def reads_hidden_states(proposer: object) -> TypeGuard[HiddenStateProposer]:
    """Whether `proposer` is fed every step's rows and hidden states (EAGLE-3). Told by its
    `propose_step`: an isinstance check against a runtime-checkable protocol took some 30 us,
    twice a step of a speculating engine."""
    return hasattr(proposer, "propose_step")


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    return NgramProposer(config) if config.method == "ngram" else SuffixProposer(config)
