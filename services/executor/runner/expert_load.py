"""A mixture of experts' load for /metrics: each expert's choices by real tokens since the
engine started serving (every layer's added up; the route kernel counts them on the device),
read at most once a second into the step answers the scheduler keeps the newest of."""

from __future__ import annotations

import time

from services.executor.models.decoder import DecoderForCausalLM

READ_INTERVAL_S = 1.0


class ExpertLoad:
    def __init__(self, model: DecoderForCausalLM, interval_s: float = READ_INTERVAL_S) -> None:
        """Counts from now on: the warm-up's and graph captures' choices are dropped."""
        self.counts = model.expert_tokens
        self.interval_s = interval_s
        self.last_read = -float("inf")
        self.ranks = expert_ranks(model)
        if self.counts is not None:
            self.counts.zero_()

    def read(self) -> tuple[list[int], list[int]]:
        """(each expert's choices, the rank holding each or -1: a part on every rank), or
        ([], []) for a model without experts or within a second of the last read. The copy
        waits for the steps in flight: it comes after a step's answer, which waited already."""
        now = time.monotonic()
        if self.counts is None or now - self.last_read < self.interval_s:
            return [], []
        self.last_read = now
        return self.counts.tolist(), self.ranks


def expert_ranks(model: DecoderForCausalLM) -> list[int]:
    """The rank that holds each expert whole (--enable-expert-parallel), else -1 for each."""
    layout, moe = model.layout, model.config.moe
    if moe is None:
        return []
    if not layout.tp.expert_parallel:
        return [-1] * moe.num_experts
    n, total = layout.tp.size, moe.num_experts
    return [next(r for r in range(n) if e < (r + 1) * total // n) for e in range(total)]
