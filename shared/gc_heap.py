"""Python's cyclic garbage collector and the engine's hot loops.

A process that has started holds hundreds of thousands of objects that are never garbage:
modules, the model's parameters and their wrappers, compiled kernels' handles, the
tokenizer. A full collection walks every one of them, 120-150 ms in which no step is
launched and the GPU's queue drains (gaps of 140 and 151 ms with no kernel, in the middle of
FP8 `offline` runs of Qwen3-30B-A3B, match a collection's time on the CPU). Moving them into
the permanent generation (`gc.freeze`) leaves the collector only what the process made since.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Iterator
from typing import Any


def freeze_startup_heap() -> None:
    """A serving process, started: collect, then freeze what is alive (a call after the
    first thaws and collects what it froze). Once a process, the scheduler too: a collection
    after its executor came back would finalize the old engine's sockets in its loop. Objects
    that become cyclic garbage while frozen (an adapter loaded at start-up and unloaded later)
    are never collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """An offline run: the heap as it stands frozen for the run's length, and thawed after,
    so that a process that builds one engine after another (tests, notebooks) can still
    collect the ones it dropped. Neither step walks the heap. A heap frozen already (a run
    within a run, or an application that froze its own) is left as its owner keeps it."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclasses.dataclass
class Collections:
    """The collections the collector ran while watched (`collections_watched`), by
    generation: how many, and their time."""

    count: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0, 0.0])
    longest_s: float = 0.0

    def report(self) -> dict[str, Any]:
        return {
            "count_by_generation": list(self.count),
            "ms_by_generation": [round(s * 1e3, 2) for s in self.seconds],
            "longest_ms": round(self.longest_s * 1e3, 2),
        }


@contextlib.contextmanager
def collections_watched() -> Iterator[Collections]:
    """Every collection run inside the block, timed (a benchmark's report: whether a gap with
    no kernel was the collector's)."""
    log = Collections()
    started = time.perf_counter()

    def timed(phase: str, info: dict[str, int]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
            return
        took = time.perf_counter() - started
        log.count[info["generation"]] += 1
        log.seconds[info["generation"]] += took
        log.longest_s = max(log.longest_s, took)

    gc.callbacks.append(timed)
    try:
        yield log
    finally:
        gc.callbacks.remove(timed)
