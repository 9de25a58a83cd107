"""The all-gather of the logits over symmetric memory: how a row is cut into the buffers'
slots, and the reference (kernels/triton_all_gather.py runs it).

With tensor parallelism each rank's lm_head gives its part of every logits row: P columns of
the vocabulary. A row's part is cut into slots of at most SLOT_WIDTH columns (the last slot
holds the remainder), so that many programs share a row at batch 1. The buffers are
`PeerBuffers` of [2, world, max_rows * slots_per_row, SLOT_WIDTH].
"""

from __future__ import annotations

import torch

from kernels.peers import PeerBuffers

SLOT_WIDTH = 4096  # columns of a slot: 8 KiB of bf16, what a program moves


def slots_per_row(part_cols: int) -> int:
    """The slots one row's part takes."""
    return -(-part_cols // SLOT_WIDTH)


def gather_takes(peers: PeerBuffers, part: torch.Tensor) -> bool:
    """Whether `part` [rows, P] (contiguous rows) fits buffers cut for parts of P columns."""
    if part.dim() != 2 or part.stride(1) != 1 or part.dtype != peers.dtype:
        return False
    rows, cols = part.shape
    max_rows = peers.slots // slots_per_row(cols) if cols else 0
    return peers.width == SLOT_WIDTH and 1 <= rows <= max_rows


def all_gather_reference(
    part: torch.Tensor,  # [M, P]: this rank's columns of each row
    peers: PeerBuffers,  # the other ranks' parts already sent to this rank, for this call
) -> torch.Tensor:  # [M, world * P]: the ranks' parts side by side, in rank order
    """What every rank gets, read where the kernel reads the peers' parts (this rank's
    buffer, each slot's half of the call's epoch); nothing waits and nothing is written. (The
    kernel gives a -0.0 as +0.0: the same value, so torch.equal holds.)"""
    rows, cols = part.shape
    per_row = slots_per_row(cols)
    slots = torch.arange(rows * per_row, device=part.device)
    half = ((peers.epochs[slots] + 1) & 1).long()  # as the kernel: the low bit, wrapped or not
    own = peers.data[peers.rank]
    parts = [
        part if rank == peers.rank else own[half, rank, slots].reshape(rows, -1)[:, :cols]
        for rank in range(peers.world)
    ]
    return torch.cat(parts, dim=-1)
