"""Rows sent between the ranks of a group over symmetric memory (`kernels.peers.PeerBuffers`),
for the one-shot collectives kernels/triton_all_reduce_norm.py and kernels/triton_all_gather.py.

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

All this holds while the ranks make the same calls with the same rows, as they run the same
plans. Ranks whose calls differed (a broken group, which the executor ends) could read a row
left over from another call rather than wait: unlike a flag, a value has no epoch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def int_of_width(dtype: torch.dtype) -> tl.dtype:
    """The integer type of a float dtype's width, to read its bits (the kernels' BITS)."""
    return {2: tl.int16, 4: tl.int32}[dtype.itemsize]


@triton.jit
def _empty_bits(shape, BITS: tl.constexpr):
    """The bits of -0.0 (the sign bit alone) in the integer type of the values' width."""
    return tl.full(shape, 1, BITS) << (BITS.primitive_bitwidth - 1)


@triton.jit
def send_row(mine, data_addresses_ptr, first, cols, mask, width, slots, RANK, WORLD, BITS):
    """Write this rank's row into its slot of every peer's buffer (buffers of [2, WORLD, slots,
    width], `first` the slot of rank 0's row in the call's half), with any -0.0 made +0.0 (the
    same value; -0.0 marks an empty slot): returns the row as sent, for the rank's own use, so
    that every rank works on the same bits. BITS: the integer type of the values' width."""
    bits = mine.to(BITS, bitcast=True)
    bits = tl.where(bits == _empty_bits(mask.shape, BITS), tl.zeros_like(bits), bits)
    mine = bits.to(mine.dtype, bitcast=True)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            # The buffers are 16-byte aligned (rows of a multiple of 8 values): vector stores.
            data = tl.load(data_addresses_ptr + peer).to(tl.pointer_type(mine.dtype))
            data = tl.multiple_of(data, 16)
            tl.store(data + (first + RANK * slots).to(tl.int64) * width + cols, mine, mask=mask)
    return mine


@triton.jit
def receive_row(ptrs, mask, BITS: tl.constexpr):
    """A peer's row at `ptrs` in this rank's buffer once every value arrived; the slot is then
    empty again (-0.0). BITS: the integer type of the values' width.

    The wait has no bound: a peer that never comes means the group is broken, and the
    executor's stall watch then ends the process (and the kernel with it)."""
    empty = _empty_bits(mask.shape, BITS)
    # volatile: from L2, where the peer's writes land, on every try
    row = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    while tl.sum((row.to(BITS, bitcast=True) == empty).to(tl.int32), axis=0) > 0:
        row = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    tl.store(ptrs, empty.to(row.dtype, bitcast=True), mask=mask)
    return row
