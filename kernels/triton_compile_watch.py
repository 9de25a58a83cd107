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
            variant = (
                f"{repr.split('(')[0]} {_constants(kwargs)} {_types(kwargs)} {_aligned(kwargs)}"
            )
            self.variants.append(variant)
            logger.warning("Triton kernel variant first met after the warm-up: %s", variant)
        return self._previous(repr=repr, **kwargs) if self._previous is not None else None


def _types(hook_kwargs: dict[str, Any]) -> str:
    """The variant's argument types (pointer dtypes, integer widths), in order."""
    signature = (hook_kwargs.get("compile") or {}).get("signature", {})
    return f"types=({', '.join(map(str, signature.values()))})"


def _aligned(hook_kwargs: dict[str, Any]) -> str:
    """The arguments the variant takes as divisible by 16 (a pointer: 16-byte aligned), by
    index: two variants of the same types and constants differ here."""
    configs = (hook_kwargs.get("compile") or {}).get("configs") or [{}]
    aligned = (
        str(key[0])
        for key, attrs in configs[0].items()
        if isinstance(key, tuple) and len(key) == 1 and ["tt.divisibility", 16] in attrs
    )
    return f"aligned=({', '.join(aligned)})"


def _constants(hook_kwargs: dict[str, Any]) -> str:
    """The variant's compile-time constants by name (Triton's `repr` lists argument types
    only), which say what the warm-up missed."""
    fn, compile_args = hook_kwargs.get("fn"), hook_kwargs.get("compile") or {}
    params = [param.name for param in getattr(getattr(fn, "jit_function", None), "params", [])]
    constants = compile_args.get("constants", {})  # {(argument index,): value} in Triton 3.9
    named = (
        f"{params[key[0]]}={value}"
        for key, value in constants.items()
        if isinstance(key, tuple) and len(key) == 1 and key[0] < len(params)
    )
    return ", ".join(named) or "(constants not told)"


_watch: LateCompiles | None = None


def late_compiles() -> LateCompiles:
    """The process's watch, hooked into Triton at the first call."""
    global _watch
    if _watch is None:
        _watch = LateCompiles()
    return _watch
