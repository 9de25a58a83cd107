"""Rows sent between the ranks of a group over symmetric memory (`kernels.all_reduce_norm.
PeerBuffers`), for the one-shot collectives kernels/triton_all_reduce_norm.py and
kernels/triton_all_gather.py.

Each rank writes its row into its slot of every peer's buffer (posted stores: no round trip,
and each peer then reads its own memory), raises its flag for the slot in every peer's flags
with a release store, and waits for every peer's flag in its own flags with acquire loads. A
flag counts as raised once it reached the call's epoch, compared through an int32 difference so
that the counters may wrap.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def send_row(mine, data_addresses_ptr, first, cols, mask, width, slots, RANK, WORLD):
    """Write this rank's row into its slot of every peer's buffer (posted stores): buffers of
    [2, WORLD, slots, width], `first` the slot of rank 0's row in the call's half."""
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            # The buffers are 16-byte aligned (rows of a multiple of 8 values): vector stores.
            data = tl.load(data_addresses_ptr + peer).to(tl.pointer_type(mine.dtype))
            data = tl.multiple_of(data, 16)
            tl.store(data + (first + RANK * slots).to(tl.int64) * width + cols, mine, mask=mask)


@triton.jit
def meet_peers(flag_addresses_ptr, row, epoch, RANK, WORLD):
    """Raise this rank's flag for slot `row` in every peer's flags ([slots, WORLD]), then wait
    for theirs in its own.

    The wait has no bound: a peer that never comes means the group is broken, and the
    executor's stall watch then ends the process (and the kernel with it)."""
    tl.debug_barrier()  # the whole row is sent before the flags say so
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flags = tl.load(flag_addresses_ptr + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flags + row * WORLD + RANK, epoch, sem="release", scope="sys")
    own_flags = tl.load(flag_addresses_ptr + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flag = own_flags + row * WORLD + peer
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            while seen - epoch < 0:  # an int32 difference: the counters may wrap
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # every thread reads the peers' rows only after the flags were seen
