"""The all-reduce after a row-parallel layer fused with the residual add and RMSNorm after it:
what its buffers take, and the reference (kernels/triton_all_reduce_norm.py runs it)."""

from __future__ import annotations

import torch

from kernels.norm import fused_add_rms_norm_reference, rms_norm_reference
from kernels.peers import PeerBuffers


def reduce_takes(peers: PeerBuffers, x: torch.Tensor) -> bool:
    """Whether `x` [rows, hidden] (contiguous rows) fits buffers of a row a slot."""
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= peers.slots
        and x.shape[1] == peers.width
        and x.stride(1) == 1
        and x.dtype == peers.dtype
    )


def all_reduce_add_rms_norm_reference(
    partial: torch.Tensor,  # [M, hidden]: this rank's part of the sum
    residual: torch.Tensor | None,  # [M, hidden]; None: nothing to add
    weight: torch.Tensor,  # [hidden]
    eps: float,
    peers: PeerBuffers,  # the other ranks' parts already sent to this rank, for this call
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual = the sum + residual)
    """What every rank gets: the ranks' parts summed in rank order in float32 and rounded to
    the model's dtype, as an all-reduce hands them on, then the fused add and RMSNorm (without
    a residual, the RMSNorm of the sum). The peers' parts are read where the kernel reads them
    (this rank's buffer, the half of the call's epoch); nothing waits and nothing is written."""
    rows = torch.arange(partial.shape[0], device=partial.device)
    half = ((peers.epochs[rows] + 1) & 1).long()  # as the kernel: the low bit, wrapped or not
    own = peers.data[peers.rank]
    total = torch.zeros(partial.shape, dtype=torch.float32, device=partial.device)
    for rank in range(peers.world):
        total += (partial if rank == peers.rank else own[half, rank, rows]).float()
    total = total.to(partial.dtype)
    if residual is None:
        return rms_norm_reference(total, weight, eps), total
    return fused_add_rms_norm_reference(total, residual, weight, eps)
