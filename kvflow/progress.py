"""A one-line progress report on stderr for long offline runs."""

from __future__ import annotations

import sys
import time
from typing import Protocol


class Progress:
    """Finished requests and output tokens per second, redrawn at most twice a second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled and total > 1
        self.done = self.tokens = 0
        self.start = self.last = time.perf_counter()

    def update(self, num_tokens: int, num_done: int) -> None:
        self.tokens += num_tokens
        self.done += num_done
        now = time.perf_counter()
        if self.enabled and (now - self.last > 0.5 or self.done == self.total):
            self.last = now
            rate = self.tokens / max(now - self.start, 1e-9)
            print(
                f"\rgenerated {self.done}/{self.total} requests, {rate:.0f} tok/s",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


class ProgressSink(Protocol):
    """Where a run reports its progress: the line on stderr, or a parent it runs for."""

    def update(self, num_tokens: int, num_done: int) -> None: ...

    def close(self) -> None: ...
