"""The all-gather of the logits over symmetric memory, in one kernel (`kernels.all_gather`).

At batch 1 with tensor parallelism, NCCL's all-gather of the lm_head's parts and the copy that
lays them side by side cost more than the bytes (128 KiB a rank for Llama-3.1-8B at two ranks).
Here a program owns a slot (one row's columns c .. c + SLOT_WIDTH of the rank's part) and:

    1. waits for the previous kernel (PDL), then writes its slot into every peer's buffer;
    2. copies every rank's slot to its place in the output row: its own from registers, each
       peer's from its buffer once it arrived, emptying the slot again (kernels/triton_peers.py).

The buffers, epochs and halves work as in kernels/triton_all_reduce_norm.py: the ranks make the
same calls with the same row counts, so a slot's counts agree. The output is a tensor of its
own, so the next call may reuse the buffers while the sampler still reads these logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.all_gather import SLOT_WIDTH, gather_takes, slots_per_row
from kernels.peers import PeerBuffers
from kernels.triton_pdl import launches_early, wait_for_previous_kernel
from kernels.triton_peers import int_of_width, receive_row, send_row


# NOTE: the slot count follows the rows; not specialised, so no row count compiles anew while
# the peer waits in its kernel.
@triton.jit(do_not_specialize=["num_slots"])
def _all_gather_kernel(
    part_ptr,  # [M, P]: this rank's part of each row
    out_ptr,  # [M, WORLD * P]
    data_addresses_ptr,  # [WORLD] int64
    epochs_ptr,  # [max slots] int32
    num_slots,  # M * slots a row
    slots_per_row,
    max_slots,
    part_cols,
    stride_part,
    stride_out,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    WIDTH: tl.constexpr,  # SLOT_WIDTH
    BITS: tl.constexpr,  # the integer type of the values' width
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
):
    wait_for_previous_kernel(PDL)
    dtype = part_ptr.dtype.element_ty
    own_data = tl.load(data_addresses_ptr + RANK).to(tl.pointer_type(dtype))
    own_data = tl.multiple_of(own_data, 16)
    offsets = tl.arange(0, WIDTH)
    # Slots g, g + G, ... in order on every rank alike; G programs all fit on the GPU at once.
    for slot in range(tl.program_id(0), num_slots, tl.num_programs(0)):
        row = (tl.full([], 0, tl.int64) + slot) // slots_per_row
        first_col = (slot % slots_per_row) * WIDTH
        mask = first_col + offsets < part_cols
        epoch = tl.load(epochs_ptr + slot) + 1
        first = (epoch & 1) * WORLD * max_slots + slot  # rank 0's copy of the slot, this call
        mine = tl.load(part_ptr + row * stride_part + first_col + offsets, mask=mask, other=0.0)
        mine = send_row(
            mine, data_addresses_ptr, first, offsets, mask, WIDTH, max_slots, RANK, WORLD, BITS
        )
        out_row = out_ptr + row * stride_out + first_col + offsets
        for rank in tl.static_range(WORLD):
            if rank == RANK:
                values = mine
            else:
                theirs = own_data + (first + rank * max_slots).to(tl.int64) * WIDTH + offsets
                values = receive_row(theirs, mask, BITS)
            tl.store(out_row + rank * part_cols, values, mask=mask)
        tl.store(epochs_ptr + slot, epoch)


def all_gather(part: torch.Tensor, peers: PeerBuffers) -> torch.Tensor:
    """`kernels.all_gather.all_gather_reference`, called by every rank of `peers`' group."""
    if not gather_takes(peers, part):
        raise ValueError(
            f"part {tuple(part.shape)} {part.dtype} does not fit the buffers "
            f"{tuple(peers.data[0].shape)} {peers.data[0].dtype}"
        )
    rows, cols = part.shape
    out = torch.empty(rows, peers.world * cols, dtype=part.dtype, device=part.device)
    num_slots = rows * slots_per_row(cols)
    early = launches_early(part)
    _all_gather_kernel[(min(num_slots, peers.max_programs),)](
        part,
        out,
        peers.data_addresses,
        peers.epochs,
        num_slots,
        slots_per_row(cols),
        peers.slots,
        cols,
        part.stride(0),
        out.stride(0),
        RANK=peers.rank,
        WORLD=peers.world,
        WIDTH=SLOT_WIDTH,
        BITS=int_of_width(part.dtype),
        PDL=early,
        num_warps=8,
        launch_pdl=early,
    )
    return out
