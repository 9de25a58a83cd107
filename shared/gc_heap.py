"""Python's cyclic garbage collector and the engine's hot loops.

A process that has started holds hundreds of thousands of objects that are never garbage:
modules, the model's parameters and their wrappers, compiled kernels' handles, the
tokenizer. A full collection walks every one of them, 120-150 ms in which no step is
launched and the GPU's queue drains (one such gap, 151 ms, in the middle of an FP8 `offline`
run of Qwen3-30B-A3B). Moving them into the permanent generation (`gc.freeze`) leaves the
collector only what the process made since.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_heap() -> None:
    """A serving process, started: collect once, then freeze what is alive. Its objects
    that become garbage in cycles later are not collected; a process that serves one
    engine for its life has none of note."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """An offline run: the heap as it stands frozen for the run's length, and thawed after,
    so that a process that builds one engine after another (tests, notebooks) can still
    collect the ones it dropped. Neither step walks the heap."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
