"""A mixture of experts' load for /metrics: each expert's choices by real tokens since the
engine started serving (every layer's added up; the route kernel counts them on the device),
read at most once a second into the step answers the scheduler keeps the newest of.

On a GPU the read never waits for the device: each read starts a copy to pinned host memory
behind the steps in flight and answers with the copy the read before started, once it landed
(so the figures are a second old)."""

from __future__ import annotations

import time

import torch

from services.executor.models.decoder import DecoderForCausalLM

READ_INTERVAL_S = 1.0


class ExpertLoad:
    def __init__(self, model: DecoderForCausalLM, interval_s: float = READ_INTERVAL_S) -> None:
        """Counts from now on: the warm-up's and graph captures' choices are dropped."""
        self.counts = model.expert_tokens
        self.interval_s = interval_s
        self.last_read = -float("inf")
        self.ranks = model.expert_ranks()
        self.host: torch.Tensor | None = None  # the copy in flight (on a GPU)
        self.copied: torch.cuda.Event | None = None
        if self.counts is not None:
            self.counts.zero_()
            if self.counts.is_cuda:
                self.host = torch.empty_like(self.counts, device="cpu").pin_memory()

    def read(self) -> tuple[list[int], list[int]]:
        """(each expert's choices, the rank holding each or -1: a part on every rank), or
        ([], []) for a model without experts, within a second of the last read, or while the
        copy is not back yet."""
        now = time.monotonic()
        if self.counts is None or now - self.last_read < self.interval_s:
            return [], []
        self.last_read = now
        if self.host is None:  # on the CPU: the steps ran already
            return self.counts.tolist(), self.ranks
        if self.copied is not None and not self.copied.query():
            return [], []
        counts = self.host.tolist() if self.copied is not None else []
        self.host.copy_(self.counts, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        return (counts, self.ranks) if counts else ([], [])
