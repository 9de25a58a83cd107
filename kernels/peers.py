"""The buffers of the one-shot collectives (kernels/triton_peers.py): memory every rank of a
tensor-parallel group maps, set up by services/executor/parallel/symmetric_memory.py."""

from __future__ import annotations

import dataclasses

import torch

MAX_WORLD = 8  # ranks of one host


@dataclasses.dataclass(frozen=True, eq=False)
class PeerBuffers:
    """A rank's view of its group's buffers: each rank's data [2, world, slots, width] (what
    each rank sent it, per epoch half; -0.0 where nothing arrived), and this rank's own call
    counts per slot. A slot is a row of the fused all-reduce, or a piece of a logits row of the
    all-gather (kernels/all_gather.py)."""

    rank: int
    data: tuple[torch.Tensor, ...]  # per rank [2, world, slots, width]; peers' mapped here
    epochs: torch.Tensor  # [slots] int32, this rank's: calls so far per slot
    data_addresses: torch.Tensor  # [world] int64: data[r].data_ptr(), on the device
    # Programs a call launches at most, the same on every rank: few enough to run all at once
    # on each GPU (the SMs of the smallest), since each waits for its peers' programs.
    max_programs: int

    @classmethod
    def of(cls, rank: int, data: tuple[torch.Tensor, ...], max_programs: int) -> PeerBuffers:
        world, (_, senders, slots, width) = len(data), data[0].shape
        if not 1 <= world <= MAX_WORLD or senders != world or width % 8:
            raise ValueError(
                f"{world} ranks (1 to {MAX_WORLD}, a buffer row each), width {width} (a "
                "multiple of 8)"
            )
        device = data[rank].device
        addresses = torch.tensor([t.data_ptr() for t in data], dtype=torch.int64, device=device)
        epochs = torch.zeros(slots, dtype=torch.int32, device=device)
        return cls(rank, data, epochs, addresses, max_programs)

    @property
    def world(self) -> int:
        return len(self.data)

    @property
    def slots(self) -> int:
        return self.data[0].shape[2]

    @property
    def width(self) -> int:
        return self.data[0].shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.data[0].dtype
