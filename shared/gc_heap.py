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
import gc
from collections.abc import Iterator


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
