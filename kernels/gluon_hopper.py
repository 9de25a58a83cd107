"""What kvflow's Gluon kernels for Hopper need (kernels/gluon_int4.py): Gluon's modules where
this Triton has them (3.5 on; None otherwise, and the kernels' Triton paths run instead), the
names that moved between Triton 3.6 (the GPU machine's) and 3.7, and whether a tensor's device
runs them (CUDA, compute capability 9.x)."""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = [
    "TensorDescriptor", "available", "constexpr_function", "fence_async_shared", "gl", "gluon",
    "mbarrier", "runs_on", "threads_barrier", "tma_load", "warpgroup_mma",
    "warpgroup_mma_wait",
]  # fmt: skip

gluon: Any = None
gl: Any = None
fence_async_shared: Any = None
mbarrier: Any = None
tma: Any = None
warpgroup_mma: Any = None
warpgroup_mma_wait: Any = None
TensorDescriptor: Any = None
constexpr_function: Any = None
tma_load: Any = None  # TMA into shared memory
threads_barrier: Any = None  # a barrier of the program's threads

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import constexpr_function

    # Up to 3.6: async_copy_global_to_shared and thread_barrier; from 3.7 on: async_load and
    # barrier.
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    threads_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
except ImportError:  # pragma: no cover - an older Triton
    gluon = None


def available() -> bool:
    return gluon is not None


@functools.cache
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def runs_on(x: torch.Tensor) -> bool:
    """Whether x's device runs the Gluon kernels: CUDA, compute capability 9.x, Gluon here."""
    return available() and x.is_cuda and _hopper(x.device.index or 0)
