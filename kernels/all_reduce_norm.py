"""The all-reduce after a row-parallel layer fused with the residual add and RMSNorm after it:
the buffers the ranks share, and the reference (kernels/triton_all_reduce_norm.py runs it)."""

from __future__ import annotations

import dataclasses

import torch

from kernels.norm import fused_add_rms_norm_reference, rms_norm_reference

MAX_WORLD = 8  # ranks of one host


@dataclasses.dataclass(frozen=True, eq=False)
class PeerBuffers:
    """A rank's view of memory every rank of its tensor-parallel group maps (symmetric memory,
    set up by services/executor/symmetric_memory.py): each rank's data buffer [2, world,
    max_rows, hidden] (what each rank sent it, per epoch half; -0.0 where nothing arrived,
    kernels/triton_peers.py), and this rank's own call counts."""

    rank: int
    data: tuple[torch.Tensor, ...]  # per rank [2, world, max_rows, hidden]; peers' mapped here
    epochs: torch.Tensor  # [max_rows] int32, this rank's: calls so far per row slot
    data_addresses: torch.Tensor  # [world] int64: data[r].data_ptr(), on the device
    # Programs a call launches at most, the same on every rank: few enough to run all at once
    # on each GPU (the SMs of the smallest), since each waits for its peers' programs.
    max_programs: int

    @classmethod
    def of(cls, rank: int, data: tuple[torch.Tensor, ...], max_programs: int) -> PeerBuffers:
        world, (_, senders, max_rows, hidden) = len(data), data[0].shape
        if not 1 <= world <= MAX_WORLD or senders != world or hidden % 8:
            raise ValueError(
                f"{world} ranks (1 to {MAX_WORLD}, a buffer row each), hidden {hidden} (a "
                "multiple of 8)"
            )
        device = data[rank].device
        addresses = torch.tensor([t.data_ptr() for t in data], dtype=torch.int64, device=device)
        epochs = torch.zeros(max_rows, dtype=torch.int32, device=device)
        return cls(rank, data, epochs, addresses, max_programs)

    @property
    def world(self) -> int:
        return len(self.data)

    @property
    def max_rows(self) -> int:
        return self.data[0].shape[2]

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` [rows, hidden] (contiguous rows) fits these buffers."""
        _, _, max_rows, hidden = self.data[0].shape
        return (
            x.dim() == 2
            and 1 <= x.shape[0] <= max_rows
            and x.shape[1] == hidden
            and x.stride(1) == 1
            and x.dtype == self.data[0].dtype
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
