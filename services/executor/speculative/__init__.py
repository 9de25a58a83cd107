"""Proposers of speculative decoding: each guesses a request's next tokens (its drafts), which
the next step verifies with the target model (shared/speculative.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

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


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    return NgramProposer(config) if config.method == "ngram" else SuffixProposer(config)
