"""The buffers of the one-shot collectives over symmetric memory: the all-reduce fused with the
norm (kernels/triton_all_reduce_norm.py) and the logits' all-gather (kernels/triton_all_gather.py).

Every rank of a tensor-parallel group on one host allocates the same buffers through
`torch.distributed._symmetric_memory`, which maps each rank's into every other's address space
(CUDA IPC over NVLink or PCIe peer access). The buffers are set up once, before the model
loads, and are their kernel's alone. Where they cannot be had (the CPU, a torch without
symmetric memory, GPUs without peer access), the model goes through NCCL, as before.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist

from kernels.all_gather import SLOT_WIDTH, slots_per_row
from kernels.peers import MAX_WORLD, PeerBuffers
from services.executor.parallel.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

# The most rows a fused all-reduce takes: the largest mixed CUDA-graph step (cuda_graphs.py's
# MIXED_GRAPH_MAX_TOKENS, not imported: that module imports this one's importers; decode graphs
# stop at the same 512 rows). Larger steps, all eager, reduce through NCCL, whose bandwidth wins.
MAX_FUSED_ROWS = 512
# The most logits rows the one-shot all-gather takes (8 MiB of buffers a rank for Llama-3.1-8B
# at two ranks). Past it the rows are many enough for NCCL's bandwidth to win.
MAX_GATHER_ROWS = 16


def with_peer_buffers(
    tp: TensorParallel, hidden: int, vocab_part: int, dtype: torch.dtype, device: torch.device
) -> TensorParallel:
    """The rank `tp` with the one-shot collectives' buffers, where the group can have them:
    for rows of `hidden` values and logits parts of `vocab_part`. Collective: every rank calls
    it at the same point."""
    if tp.size == 1:
        return tp
    reduce_peers = reduce_buffers(tp, hidden, dtype, device)
    # Both or neither: the gather's setup follows the all-reduce's (the same conditions, and a
    # group that failed one would only log the same warning twice).
    gather_peers = None
    if reduce_peers is not None:
        gather_peers = gather_buffers(tp, vocab_part, dtype, device)
    return dataclasses.replace(tp, reduce_peers=reduce_peers, gather_peers=gather_peers)


def reduce_buffers(
    tp: TensorParallel, hidden: int, dtype: torch.dtype, device: torch.device
) -> PeerBuffers | None:
    """The fused all-reduce's buffers for rows of `hidden` values, or None (with the reason
    logged). Collective: every rank of the group calls it at the same point."""
    if hidden % 8:
        return None
    what = f"fused all-reduce + RMSNorm of up to {MAX_FUSED_ROWS} rows"
    return _peer_buffers(tp, MAX_FUSED_ROWS, hidden, dtype, device, what)


def gather_buffers(
    tp: TensorParallel, part_cols: int, dtype: torch.dtype, device: torch.device
) -> PeerBuffers | None:
    """The logits all-gather's buffers for parts of `part_cols` columns a rank, or None.
    Collective, as reduce_buffers."""
    slots = MAX_GATHER_ROWS * slots_per_row(part_cols)
    what = f"logits all-gather of up to {MAX_GATHER_ROWS} rows"
    return _peer_buffers(tp, slots, SLOT_WIDTH, dtype, device, what)


def _peer_buffers(
    tp: TensorParallel,
    slots: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    what: str,  # the collective they serve, for the log
) -> PeerBuffers | None:
    """`tp`'s group's buffers of `slots` rows of `width` values, or None (with the reason
    logged). Collective: every rank of the group calls it at the same point."""
    rank, world = tp.rank, tp.size
    if world == 1 or device.type != "cuda" or world > MAX_WORLD:
        return None
    others = [d for d in range(world) if d != device.index]  # the group's: rank r on cuda:r
    try:  # any failure here is this rank's alone: agree before the collective rendezvous
        if not all(torch.cuda.can_device_access_peer(device, d) for d in others):
            raise RuntimeError("the GPUs cannot access each other's memory")
        import torch.distributed._symmetric_memory as symm_mem

        data = symm_mem.empty(2, world, slots, width, dtype=dtype, device=device)
        data.fill_(-0.0)  # every slot empty (kernels/triton_peers.py)
        programs = torch.cuda.get_device_properties(device).multi_processor_count
    except Exception as exc:  # whatever it is, NCCL serves instead
        logger.warning("%s off: symmetric memory unavailable (%s)", what, exc)
        programs = 0
    programs = tp.smallest(programs, device)  # one count on every rank
    if not programs:
        return None
    group_name = (tp.group or dist.group.WORLD).group_name
    try:
        handle = symm_mem.rendezvous(data, group_name)
        if handle.rank != rank:
            raise RuntimeError(f"symmetric memory rank {handle.rank} against {rank}")
        peers = PeerBuffers.of(
            rank, tuple(_mapped(handle, r, data) for r in range(world)), programs
        )
    except Exception as exc:  # e.g. no IPC between the ranks' containers
        logger.warning("%s off: the ranks' buffers were not mapped (%s)", what, exc)
        peers = None
    if not tp.smallest(int(peers is not None), device):
        return None
    torch.cuda.synchronize(device)
    dist.barrier(group=tp.group)  # every rank's slots are empty before any rank sends
    logger.info("%s over symmetric memory: %d ranks", what, world)
    return peers


def _mapped(handle: Any, rank: int, own: torch.Tensor) -> torch.Tensor:
    """Rank `rank`'s buffer as a tensor in this process (its own buffer for itself)."""
    return own if rank == handle.rank else handle.get_buffer(rank, tuple(own.shape), own.dtype)
