"""The (token, expert) pairs sorted by expert for kernels/triton_moe.py's grouped GEMMs, on the
device: `align`, the layout of `kernels.moe.align_reference` exactly (pairs in pair order within
their expert, each expert's group padded to the block), in Triton.

- Up to ONE_PROGRAM_MAX_PAIRS pairs (a decode step's) one launch of one program, which walks
  the pairs twice: to count each expert's, then to place each after its expert's earlier ones.
- Past that, three launches over chunks of pairs (64 with 128 experts), with no atomics (so
  the layout is the same on every run and every device):
    1. count   each chunk's pairs by expert ([chunks, E]); the slots set empty (the pair count)
    2. scan    over the chunks, per expert: where each chunk's pairs of that expert start
               within the expert's group, and the expert's total
    3. place   each pair at its expert's group start (from the totals, padded) + its chunk's
               start + its rank among the chunk's pairs of that expert; each block its expert
  The torch reference takes a dozen launches (a stable argsort among them) for the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe import align_reference, aligned_size
from kernels.triton_moe_route import MAX_EXPERTS

# The one-program kernel's bound: its walk grows with the pairs, the three launches' time
# hardly does. H100, 2026-12-06 (sweeps/moe_profile.py, E = 128, device time): one program
# 7.8 us at 64 pairs, 28.4 at 512, 98.0 at 2,048; the three launches 11-12 us at 512 to 8,192.
ONE_PROGRAM_MAX_PAIRS = 128
ONE_PROGRAM_VALUES = 4096  # chunk x experts comparisons a step holds (and chunk x chunk <= it)
PARALLEL_VALUES = 8192  # chunk x experts comparisons a program of the parallel kernels holds
SCAN_EXPERTS = 16  # experts a program of the scan takes
SCAN_ROWS = 64  # chunks a step of the scan takes


@triton.jit(do_not_specialize=["num_pairs", "size"])  # every count one variant
def _align_kernel(
    ids_ptr,  # [pairs]: each pair's expert
    sorted_ptr,  # [size] int32
    block_expert_ptr,  # [size / BLOCK_M] int32
    num_pairs,
    num_experts,
    size,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program walks the pairs twice, CHUNK at a time: to count each expert's, then to
    place each after its expert's earlier ones (the order a stable sort gives)."""
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        e = tl.load(ids_ptr + start + lanes, mask=start + lanes < num_pairs, other=-1)
        counts += tl.sum((e.to(tl.int32)[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # past each expert's group; experts >= E have none
    for start in range(0, size, CHUNK):
        tl.store(sorted_ptr + start + lanes, num_pairs, mask=start + lanes < size)
    for start in range(0, size // BLOCK_M, CHUNK):
        _store_block_experts(block_expert_ptr, ends, start + lanes, num_experts, size // BLOCK_M,
                             BLOCK_M)  # fmt: skip
    tl.debug_barrier()  # the empty slots are written before any pair's
    free = ends - padded  # each expert's next slot
    for start in range(0, num_pairs, CHUNK):
        pairs = start + lanes
        e = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
        mine = e[:, None] == experts[None, :]  # [CHUNK, BLOCK_E]
        base = tl.sum(tl.where(mine, free[None, :], 0), axis=1)
        placed = (pairs < num_pairs) & (e >= 0)  # -1: another rank's expert, left out
        tl.store(sorted_ptr + base + _rank_in_chunk(e, lanes), pairs, mask=placed)
        free += tl.sum(mine.to(tl.int32), axis=0)


@triton.jit
def _rank_in_chunk(e, lanes):
    """Each lane's rank among the lanes before it with the same expert."""
    earlier = (e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None])
    return tl.sum(earlier.to(tl.int32), axis=1)


@triton.jit
def _store_block_experts(block_expert_ptr, ends, blocks, num_experts, num_blocks,
                         BLOCK_M: tl.constexpr):  # fmt: skip
    """Each of `blocks` told its expert: the first whose group ends past it (-1: none)."""
    owner = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    owner = tl.where(owner < num_experts, owner, -1)
    tl.store(block_expert_ptr + blocks, owner, mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["num_pairs", "size"])
def _count_kernel(
    ids_ptr,  # [pairs]
    counts_ptr,  # [chunks, BLOCK_E] int32
    sorted_ptr,  # [size] int32
    num_pairs,
    size,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Chunk `program_id`'s pairs counted by expert, and its share of the slots set empty."""
    chunk = tl.program_id(0)
    lanes = chunk * CHUNK + tl.arange(0, CHUNK)
    experts = tl.arange(0, BLOCK_E)
    if chunk * CHUNK < num_pairs:
        e = tl.load(ids_ptr + lanes, mask=lanes < num_pairs, other=-1).to(tl.int32)
        counts = tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
        tl.store(counts_ptr + chunk * BLOCK_E + experts, counts)
    for start in range(chunk * CHUNK, size, tl.num_programs(0) * CHUNK):
        slots = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + slots, num_pairs, mask=slots < size)


@triton.jit(do_not_specialize=["num_chunks"])
def _scan_kernel(
    counts_ptr,  # [chunks, BLOCK_E] int32
    starts_ptr,  # [chunks, BLOCK_E] int32: where each chunk's pairs start in their expert's
    totals_ptr,  # [BLOCK_E] int32
    num_chunks,
    BLOCK_E: tl.constexpr,
    EXPERTS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Experts program_id * EXPERTS ..: each chunk's count, summed over the chunks before it."""
    experts = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)
    rows = tl.arange(0, ROWS)
    carry = tl.zeros((EXPERTS,), dtype=tl.int32)
    for first in range(0, num_chunks, ROWS):
        offsets = (first + rows)[:, None] * BLOCK_E + experts[None, :]
        valid = (first + rows < num_chunks)[:, None]
        counts = tl.load(counts_ptr + offsets, mask=valid, other=0)
        starts = carry[None, :] + tl.cumsum(counts, axis=0) - counts
        tl.store(starts_ptr + offsets, starts, mask=valid)
        carry += tl.sum(counts, axis=0)
    tl.store(totals_ptr + experts, carry)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _place_kernel(
    ids_ptr,  # [pairs]
    starts_ptr,  # [chunks, BLOCK_E] int32
    totals_ptr,  # [BLOCK_E] int32 (0 past the experts)
    sorted_ptr,  # [size] int32
    block_expert_ptr,  # [num_blocks] int32
    num_pairs,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Chunk `program_id`'s pairs in their slots, and CHUNK blocks told their experts."""
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    totals = tl.load(totals_ptr + experts)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    _store_block_experts(block_expert_ptr, ends, chunk * CHUNK + lanes, num_experts, num_blocks,
                         BLOCK_M)  # fmt: skip
    pairs = chunk * CHUNK + lanes
    if chunk * CHUNK < num_pairs:
        e = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
        placed = (pairs < num_pairs) & (e >= 0)  # -1: another rank's expert, left out
        e_safe = tl.where(placed, e, 0)
        group_start = tl.sum(tl.where(e_safe[:, None] == experts[None, :], ends - padded, 0), 1)
        chunk_start = tl.load(starts_ptr + chunk * BLOCK_E + e_safe)
        slots = group_start + chunk_start + _rank_in_chunk(e, lanes)
        tl.store(sorted_ptr + slots, pairs, mask=placed)


def align(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:  # sorted pairs [P] int32, block experts [P / BLOCK_M]
    """The pairs (token t's j-th choice is pair t * k + j) by expert, in pair order within
    an expert, each expert's group padded to block_m with the pair count (no pair), and each
    block's expert (-1 past the last group); P = aligned_size. Pairs of expert -1 (another
    rank's) are left out. Up to ONE_PROGRAM_MAX_PAIRS pairs one launch, past them three
    (module docstring)."""
    num_pairs = ids.numel()
    if num_experts > MAX_EXPERTS:
        return align_reference(ids, num_experts, block_m)
    size = aligned_size(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(size, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    block_e = triton.next_power_of_2(num_experts)
    ids = ids.contiguous()
    if num_pairs <= ONE_PROGRAM_MAX_PAIRS:
        _align_kernel[(1,)](
            ids, sorted_pairs, block_experts, num_pairs, num_experts, size,
            BLOCK_M=block_m, BLOCK_E=block_e,
            CHUNK=min(64, max(16, ONE_PROGRAM_VALUES // block_e)),
        )  # fmt: skip
        return sorted_pairs, block_experts
    _align_in_parallel(ids, sorted_pairs, block_experts, num_experts, block_m)
    return sorted_pairs, block_experts


def _align_in_parallel(
    ids: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_experts: torch.Tensor,
    num_experts: int,
    block_m: int,
) -> None:
    """`align`'s three launches (module docstring), into `sorted_pairs` and `block_experts`."""
    num_pairs, size, num_blocks = ids.numel(), sorted_pairs.numel(), block_experts.numel()
    block_e = max(triton.next_power_of_2(num_experts), SCAN_EXPERTS)
    chunk = max(16, min(64, PARALLEL_VALUES // block_e))  # pairs (and blocks) a program
    num_chunks = triton.cdiv(num_pairs, chunk)
    # Every row of counts is written whole: 0 past the experts (their totals too: no group).
    counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=ids.device)
    starts = torch.empty_like(counts)
    totals = torch.empty(block_e, dtype=torch.int32, device=ids.device)
    grid = (max(num_chunks, triton.cdiv(num_blocks, chunk)),)
    _count_kernel[grid](ids, counts, sorted_pairs, num_pairs, size, BLOCK_E=block_e, CHUNK=chunk)
    _scan_kernel[(block_e // SCAN_EXPERTS,)](
        counts, starts, totals, num_chunks, BLOCK_E=block_e, EXPERTS=SCAN_EXPERTS, ROWS=SCAN_ROWS
    )
    _place_kernel[grid](
        ids, starts, totals, sorted_pairs, block_experts, num_pairs, num_experts, num_blocks,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk,
    )  # fmt: skip
