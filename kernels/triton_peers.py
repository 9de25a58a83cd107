"""Rows sent between the ranks of a group over symmetric memory (`kernels.all_reduce_norm.
PeerBuffers`), for the one-shot collectives kernels/triton_all_reduce_norm.py and
kernels/triton_all_gather.py.

A slot of a rank's buffer holds what one peer sent it for one row. Negative zero marks a slot
not written yet (every slot starts so): a rank sends its row with any -0.0 made +0.0 (equal
values, so no sum changes), writing it straight into its slot of every peer's buffer (posted
stores: no round trip), and each rank waits on its own buffer until no value of a peer's row is
-0.0 any more, then reads it and marks the slot empty again. Every value carries its own
"arrived" bit, so no flag, fence or second round trip over NVLink is needed (the
Lamport-style one-shot all-reduce of TensorRT-LLM and FlashInfer).

A slot is written again two calls later (the buffer half is the call's epoch's low bit): by
then its reader has emptied it, because the call in between waited for the reader's row, which
the reader sends only after the call that emptied the slot completed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def int_of_width(dtype: torch.dtype) -> tl.dtype:
    """The integer type of a float dtype's width, to read its bits (`receive_row`'s BITS)."""
    return {2: tl.int16, 4: tl.int32}[dtype.itemsize]


@triton.jit
def without_negative_zero(row):
    """row with -0.0 made +0.0 (the same values): -0.0 marks an empty slot."""
    return tl.where(row == 0, tl.zeros_like(row), row)


@triton.jit
def send_row(mine, data_addresses_ptr, first, cols, mask, width, slots, RANK, WORLD):
    """Write this rank's row (without negative zeros) into its slot of every peer's buffer:
    buffers of [2, WORLD, slots, width], `first` the slot of rank 0's row in the call's half."""
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            # The buffers are 16-byte aligned (rows of a multiple of 8 values): vector stores.
            data = tl.load(data_addresses_ptr + peer).to(tl.pointer_type(mine.dtype))
            data = tl.multiple_of(data, 16)
            tl.store(data + (first + RANK * slots).to(tl.int64) * width + cols, mine, mask=mask)


@triton.jit
def receive_row(ptrs, mask, BITS: tl.constexpr):
    """A peer's row at `ptrs` in this rank's buffer once every value arrived; the slot is then
    empty again (-0.0). BITS: the integer type of the values' width.

    The wait has no bound: a peer that never comes means the group is broken, and the
    executor's stall watch then ends the process (and the kernel with it)."""
    empty = tl.full(mask.shape, 1, BITS) << (BITS.primitive_bitwidth - 1)  # -0.0's bits
    # volatile: from L2, where the peer's writes land, on every try
    row = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    while tl.sum((row.to(BITS, bitcast=True) == empty).to(tl.int32), axis=0) > 0:
        row = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    tl.store(ptrs, empty.to(row.dtype, bitcast=True), mask=mask)
    return row
