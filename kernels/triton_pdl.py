"""Programmatic dependent launch (PDL): a kernel's programs start while the kernel before it ends.

Without it, a kernel in a stream (or a CUDA graph) is launched only once the one before it has
finished and its writes are flushed: at batch 1, where a decode step is some 350 short kernels,
those gaps and each kernel's ramp-up are a measurable share of the step. With PDL (Hopper and
later) the next kernel's programs are placed on the SMs as soon as every program of the running
kernel has said it may (`gdc_launch_dependents`), and each waits in `gdc_wait` until the running
kernel has completed and its memory is visible.

The rule that keeps this correct, for every kernel launched with `launch_pdl=True`:
  every program calls `wait_for_previous_kernel` before it reads anything another kernel
  writes and before it writes anything, and it never returns before that call.
Then a kernel completes only after the one before it did, so a chain of PDL kernels, or one
mixed with ordinary launches (cuBLAS, NCCL, torch ops, int4's fallback kernels), keeps stream order
for every byte. Before the wait a program may only compute addresses and `prefetch_to_l2` the
weights it reads first: a prefetch fills L2, which is where device memory is coherent, so it
can never return a value older than the previous kernel's writes.

Measured on an H100 (docs/benchmarks-history.md, "programmatic dependent launch"): Llama-3.1-8B
decode at batch 1 went from 5.83 to 5.67 ms in bf16 and from 3.96 to 3.76 ms in FP8. int4's tl.dot
kernel launches with it too (2.96 against 3.06 ms at batch 1, 2026-11-28); its fallbacks
(the CUDA-core rows kernel, whose step was 3 % slower with it, and dequant_dot) do not.

`--disable-pdl` (kernels/pdl.py) launches everything the ordinary way.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.pdl import pdl_enabled

L2_LINE_BYTES = 128


@functools.cache
def _device_takes_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def launches_early(tensor: torch.Tensor) -> bool:
    """Whether kernels on `tensor`'s device launch with PDL (CUDA, compute capability >= 9.0,
    unless --disable-pdl). Never under TRITON_INTERPRET (its tensors are on the CPU)."""
    return pdl_enabled() and tensor.is_cuda and _device_takes_pdl(tensor.device.index or 0)


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Wait until the kernel before this one has completed; then let the next one launch."""
    if PDL:
        gdc_wait()
        # After the wait, so that at most two kernels' programs share the SMs at once.
        gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(ptrs):
    """Start reading the lines `ptrs` point into (one pointer per 128-byte line) into L2,
    without waiting for them; for data no kernel writes (the weights), before the wait."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
