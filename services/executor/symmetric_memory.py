"""The buffers of the fused all-reduce (kernels/triton_all_reduce_norm.py) in symmetric memory.

Every rank of a tensor-parallel group on one host allocates the same buffers through
`torch.distributed._symmetric_memory`, which maps each rank's into every other's address space
(CUDA IPC over NVLink or PCIe peer access). The buffers are set up once, before the model
loads, and are the kernel's alone. Where they cannot be had (the CPU, a torch without symmetric
memory, GPUs without peer access), the model reduces through NCCL and norms apart, as before.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kernels.all_reduce_norm import MAX_WORLD, PeerBuffers

if TYPE_CHECKING:  # tensor_parallel imports this module
    from services.executor.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

# The most rows a call takes: the largest mixed CUDA-graph step (cuda_graphs.py's
# MIXED_GRAPH_MAX_TOKENS, not imported: that module imports this one's importers). Decode graphs
# past it (--max-num-seqs > 512) and larger eager steps reduce through NCCL, whose bandwidth wins.
MAX_FUSED_ROWS = 512


def peer_buffers(
    tp: TensorParallel, hidden: int, dtype: torch.dtype, device: torch.device
) -> PeerBuffers | None:
    """`tp`'s group's buffers for rows of `hidden` values, or None (with the reason logged).
    Collective: every rank of the group calls it at the same point."""
    rank, world = tp.rank, tp.size
    if world == 1 or device.type != "cuda" or world > MAX_WORLD or hidden % 8:
        return None
    others = [d for d in range(torch.cuda.device_count()) if d != device.index]
    try:  # any failure here is this rank's alone: agree before the collective rendezvous
        if not all(torch.cuda.can_device_access_peer(device, d) for d in others):
            raise RuntimeError("the GPUs cannot access each other's memory")
        import torch.distributed._symmetric_memory as symm_mem

        data = symm_mem.empty(2, world, MAX_FUSED_ROWS, hidden, dtype=dtype, device=device)
        flags = symm_mem.empty(MAX_FUSED_ROWS, world, dtype=torch.int32, device=device)
        flags.zero_()
        programs = torch.cuda.get_device_properties(device).multi_processor_count
    except Exception as exc:  # whatever it is, NCCL serves instead
        logger.warning("fused all-reduce off: symmetric memory unavailable (%s)", exc)
        programs = 0
    programs = tp.smallest(programs, device)  # one count on every rank
    if not programs:
        return None
    group_name = (tp.group or dist.group.WORLD).group_name
    try:
        handles = symm_mem.rendezvous(data, group_name), symm_mem.rendezvous(flags, group_name)
        if any(handle.rank != rank for handle in handles):
            raise RuntimeError(f"symmetric memory ranks {handles[0].rank} against {rank}")
        peers = PeerBuffers.of(
            rank,
            tuple(_mapped(handles[0], r, data) for r in range(world)),
            tuple(_mapped(handles[1], r, flags) for r in range(world)),
            programs,
        )
    except Exception as exc:  # e.g. no IPC between the ranks' containers
        logger.warning("fused all-reduce off: the ranks' buffers could not be mapped (%s)", exc)
        peers = None
    if not tp.smallest(int(peers is not None), device):
        return None
    torch.cuda.synchronize(device)
    dist.barrier(group=tp.group)  # every rank's flags are zero before any rank raises one
    logger.info(
        "fused all-reduce + RMSNorm over symmetric memory: %d ranks, up to %d rows",
        world,
        MAX_FUSED_ROWS,
    )
    return peers


def _mapped(handle: Any, rank: int, own: torch.Tensor) -> torch.Tensor:
    """Rank `rank`'s buffer as a tensor in this process (its own buffer for itself)."""
    return own if rank == handle.rank else handle.get_buffer(rank, tuple(own.shape), own.dtype)
