"""Which device and dtype a rank runs on, from the --device and --dtype flags, and where its
start-up ends."""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """The device of tensor-parallel rank `rank` (GPU `rank`, on CUDA)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name, rank) if name == "cuda" else torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def start_up_compiles(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """On a GPU, where Triton's compiles are the start-up's (kernels/triton_compile_watch.py)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from kernels.triton_compile_watch import late_compiles  # Triton: on GPUs only

    return late_compiles().warming_up()
