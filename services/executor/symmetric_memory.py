"""The buffers of the fused all-reduce (kernels/triton_all_reduce_norm.py) in symmetric memory.

Every rank of a tensor-parallel group on one host allocates the same buffers through
`torch.distributed._symmetric_memory`, which maps each rank's into every other's address space
(CUDA IPC over NVLink or PCIe peer access). The buffers are set up once, before the model
loads, and are the kernel's alone. Where they cannot be had (the CPU, a torch without symmetric
memory, GPUs without peer access), the model reduces through NCCL and norms apart, as before.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from kernels.all_reduce_norm import MAX_WORLD, PeerBuffers

logger = logging.getLogger(__name__)

# A step's rows the fused kernel takes: every CUDA-graph shape (services/executor/cuda_graphs.py
# captures up to 512 rows); larger eager steps reduce through NCCL, whose bandwidth wins there.
MAX_FUSED_ROWS = 512


def peer_buffers(
    rank: int, world: int, group: dist.ProcessGroup | None, hidden: int, dtype: torch.dtype,
    device: torch.device,
) -> PeerBuffers | None:  # fmt: skip
    """The group's buffers for rows of `hidden` values, or None (with the reason logged).
    Collective: every rank of the group calls it at the same point."""
    if world == 1 or device.type != "cuda" or world > MAX_WORLD or hidden % 8:
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        data = symm_mem.empty(2, world, MAX_FUSED_ROWS, hidden, dtype=dtype, device=device)
        flags = symm_mem.empty(MAX_FUSED_ROWS, world, dtype=torch.int32, device=device)
        flags.zero_()
        allocated = True
    except (ImportError, RuntimeError) as exc:
        logger.warning("fused all-reduce off: symmetric memory unavailable (%s)", exc)
        allocated = False
    # Every rank must take the same path: rendezvous is collective.
    agreed = torch.tensor([int(allocated)], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if not agreed.item():
        return None
    group_name = (group or dist.group.WORLD).group_name
    data_handle = symm_mem.rendezvous(data, group_name)
    flag_handle = symm_mem.rendezvous(flags, group_name)
    peers = PeerBuffers.of(
        rank,
        tuple(_mapped(data_handle, r, data) for r in range(world)),
        tuple(_mapped(flag_handle, r, flags) for r in range(world)),
    )
    torch.cuda.synchronize(device)
    dist.barrier(group=group)  # every rank's flags are zero before any rank raises one
    logger.info(
        "fused all-reduce + RMSNorm over symmetric memory: %d ranks, up to %d rows",
        world,
        MAX_FUSED_ROWS,
    )
    return peers


def _mapped(handle: object, rank: int, own: torch.Tensor) -> torch.Tensor:
    """Rank `rank`'s buffer as a tensor in this process (its own buffer for itself)."""
    if rank == handle.rank:  # type: ignore[attr-defined]
        return own
    return handle.get_buffer(rank, tuple(own.shape), own.dtype)  # type: ignore[attr-defined]
