"""Proposers of speculative decoding: each guesses a request's next tokens (its drafts), which
the next step verifies with the target model (shared/speculative.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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


class PendingDrafts:
    """A step's drafts on their way to the host (a draft model's or EAGLE-3 head's, proposed
    on the device right after the step): by row of the step, its request, whether it drafted
    and its blocks at the step's launch; the drafts [k, rows], copied to host memory, and the
    event after the copy."""

    def __init__(
        self,
        request_ids: list[str],
        drafting: list[bool],
        num_blocks: list[int],
        ids: torch.Tensor,
        ready: torch.cuda.Event | None,
    ) -> None:
        self.request_ids, self.drafting, self.num_blocks = request_ids, drafting, num_blocks
        self._ids, self._ready = ids, ready

    def columns(self) -> list[list[int]]:
        """Draft j of every row, by j: waits for the copy."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._ids.tolist()


class DeviceProposer(Protocol):
    """A proposer that runs a model of its own (a draft model, an EAGLE-3 head): it proposes
    on the device after every step, and the host takes the drafts once the step is
    collected."""

    def take_drafts(
        self,
        proposal: PendingDrafts,
        wanted: set[str],
        requests: Mapping[str, SpeculatingRequest],
    ) -> dict[str, list[int]]:
        """Once the step's tokens are known: drafts for the `wanted` requests."""
        ...

    def finished(self, request_id: str, output_token_ids: list[int]) -> None: ...

    def reset(self) -> None: ...


def proposes_on_device(proposer: object) -> TypeGuard[DeviceProposer]:
    """Whether `proposer` proposes on the device after every step (a draft model, EAGLE-3).
    Told by its `take_drafts`: an isinstance check against a runtime-checkable protocol took
    some 30 us, twice a step of a speculating engine."""
    return hasattr(proposer, "take_drafts")


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    return NgramProposer(config) if config.method == "ngram" else SuffixProposer(config)
