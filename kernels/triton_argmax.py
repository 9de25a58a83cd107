"""Row-wise argmax over a large vocabulary, in Triton, in two passes.

Same result as `kernels.argmax.argmax_reference` (the first index of the maximum). torch's
reduction gives each row to one block of threads, so a decode step's [1, 128256] logits take
~37 us on an H100; here the row is cut into chunks reduced in parallel, then the chunk winners:

    logits row  [ chunk 0 | chunk 1 | ... | chunk C-1 ]   pass 1: (max, index) per chunk
                     \\         |              /          pass 2: the first chunk of the max
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_pdl import launches_early, wait_for_previous_kernel

_CHUNK = 4096  # logits per pass-1 program
_MAX_CHUNKS = 1024  # pass 2 reduces all chunk winners of a row in one tile


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr,
    best_value_ptr,
    best_index_ptr,
    vocab,
    stride_row,
    num_chunks,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    values = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf"))
    values = values.to(tl.float32)
    # NOTE: the first maximum of the chunk (tie_break_left), so the overall first one wins below.
    value, index = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_value_ptr + row * num_chunks + chunk, value)
    tl.store(best_index_ptr + row * num_chunks + chunk, chunk * CHUNK + index)


@triton.jit
def _row_argmax_kernel(
    best_value_ptr,
    best_index_ptr,
    offsets_ptr,  # [V] int64, read where HAS_OFFSETS
    out_ptr,
    num_chunks,
    stride_out,
    CHUNKS: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)  # [CHUNKS]
    valid = chunks < num_chunks
    values = tl.load(best_value_ptr + row * num_chunks + chunks, mask=valid, other=float("-inf"))
    _, winner = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    index = tl.load(best_index_ptr + row * num_chunks + winner).to(tl.int64)
    if HAS_OFFSETS:
        index += tl.load(offsets_ptr + index)
    tl.store(out_ptr + row * stride_out, index)


def argmax(
    logits: torch.Tensor,  # [R, V], V contiguous
    offsets: torch.Tensor | None = None,  # [V] int64: added to the index found
    out: torch.Tensor | None = None,  # [R] int64, any stride
) -> torch.Tensor:  # [R] int64
    """`kernels.argmax.argmax_reference`: the first index of each row's maximum (+ offsets)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [R, V] with V contiguous, got {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, _CHUNK)
    if vocab == 0 or num_chunks > _MAX_CHUNKS:
        raise ValueError(f"argmax takes 1 to {_CHUNK * _MAX_CHUNKS} columns, got {vocab}")
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)  # [R]
    elif out.shape != (num_rows,) or out.dtype != torch.int64:
        raise ValueError(f"out must be [{num_rows}] int64, got {tuple(out.shape)} {out.dtype}")
    if num_rows == 0:
        return out
    f32 = dict(device=logits.device, dtype=torch.float32)
    best_value = torch.empty(num_rows, num_chunks, **f32)  # [R, C]
    best_index = torch.empty(num_rows, num_chunks, device=logits.device, dtype=torch.int32)
    early = launches_early(logits)
    _chunk_argmax_kernel[(num_rows, num_chunks)](
        logits, best_value, best_index, vocab, logits.stride(0), num_chunks, CHUNK=_CHUNK,
        PDL=early, launch_pdl=early,
    )  # fmt: skip
    chunks = max(2, triton.next_power_of_2(num_chunks))
    _row_argmax_kernel[(num_rows,)](
        best_value, best_index, offsets if offsets is not None else out, out, num_chunks,
        out.stride(0), CHUNKS=chunks, HAS_OFFSETS=offsets is not None, PDL=early,
        launch_pdl=early,
    )  # fmt: skip
    return out
