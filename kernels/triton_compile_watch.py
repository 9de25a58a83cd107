"""Triton kernel variants a process meets for the first time outside its warm-up.

Triton compiles a kernel variant the first time a process launches it with new constants (or
loads it from its disk cache, if an earlier process compiled it). The warm-up at start (graph
capture and services/executor/runner/warm_up.py) is meant to meet every variant a step uses; one it
misses is compiled inside a request's step, which on a fresh machine stalls every running
request for the compile (0.1-1 s a variant). `late_compiles()` logs each such variant with its
constants, so the gap shows in the server's log, in `bench throughput`'s JSON and in the GPU
tests.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from triton import knobs

logger = logging.getLogger(__name__)


class LateCompiles:
    """Records and logs the kernel variants compiled or loaded outside `warming_up()`, through
    Triton's jit_cache_hook (called before each compile of a variant new to the process). A
    hook that was set before is still called, and still decides."""

    def __init__(self) -> None:
        self.variants: list[str] = []
        self._warming_up = 0
        self._previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._on_compile

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        """Compiles in here are the warm-up's: meant, and not recorded."""
        self._warming_up += 1
        try:
            yield
        finally:
            self._warming_up -= 1

    def _on_compile(self, *, repr: str, **kwargs: Any) -> bool | None:  # Triton names `repr`
        if not self._warming_up:
            self.variants.append(repr)
            logger.warning("Triton kernel variant first met after the warm-up: %s", repr)
        return self._previous(repr=repr, **kwargs) if self._previous is not None else None


_watch: LateCompiles | None = None


def late_compiles() -> LateCompiles:
    """The process's watch, hooked into Triton at the first call."""
    global _watch
    if _watch is None:
        _watch = LateCompiles()
    return _watch
