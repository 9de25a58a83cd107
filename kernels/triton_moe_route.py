"""A mixture of experts' routing in one Triton launch: per token, the router's logits to the
top k experts and their weights. Same math as `kernels.moe.moe_route_reference`. And `align`,
which sorts the (token, expert) pairs by expert for kernels/triton_moe.py's grouped GEMMs.

The reference takes a softmax, a top-k and (renormalizing) a sum and a division: four or five
kernels a layer, which at decode cost more than their work (48 layers of Qwen3-30B-A3B: some
200 launches a step). Here one program owns a token's row of E logits (E <= 1024 fits in its
registers) and picks the k largest one at a time, ties to the lower expert. The choice is made
on the logits themselves (softmax keeps their order), so it is the reference's choice but for
exact ties; each weight is then exp(logit - max) / sum, over the k chosen (renormalized) or all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe import align_reference, aligned_size

MAX_EXPERTS = 1024  # a row of logits held in one program's registers
ALIGN_KERNEL_MAX_PAIRS = 2048  # align's one-program kernel: a walk of 64 chunks (E = 128)
ALIGN_CHUNK_VALUES = 4096  # chunk x experts comparisons a step holds (and chunk x chunk <= it)


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E]
    weights_ptr,  # [T, k] float32
    ids_ptr,  # [T, k] int64
    counts_ptr,  # [E] int64 with COUNT: each expert's choices, added to
    slots_ptr,  # [T] with SLOTS: the tokens' KV slots (< 0: padding, not counted)
    num_experts,
    top_k,
    stride_logits,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COUNT: tl.constexpr,
    SLOTS: tl.constexpr,
):
    token = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    row = logits_ptr + token.to(tl.int64) * stride_logits
    logits = tl.load(row + experts, mask=experts < num_experts, other=-float("inf"))
    logits = logits.to(tl.float32)
    logits = tl.where(logits == logits, logits, -float("inf"))  # NaN: never before a number
    top = tl.max(logits, axis=0)
    total = tl.sum(tl.exp(logits - top), axis=0)  # the softmax's denominator over all experts
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), dtype=tl.float32)
    chosen_ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    taken = experts >= num_experts  # each expert once, and only real ones, whatever the row
    for slot in range(top_k):
        best = tl.max(tl.where(taken, -float("inf"), logits), axis=0)
        expert = tl.min(tl.where((logits == best) & ~taken, experts, BLOCK_E), axis=0)
        chosen = tl.where(slots == slot, tl.exp(best - top), chosen)
        chosen_ids = tl.where(slots == slot, expert.to(tl.int64), chosen_ids)
        taken = taken | (experts == expert)
    if RENORMALIZE:
        total = tl.sum(tl.where(slots < top_k, chosen, 0.0), axis=0)
    out = token.to(tl.int64) * top_k + slots
    tl.store(weights_ptr + out, chosen / total, mask=slots < top_k)
    tl.store(ids_ptr + out, chosen_ids, mask=slots < top_k)
    if COUNT:  # integer adds: the sum is exact in any order
        one = tl.full((BLOCK_K,), 1, dtype=tl.int64)
        if SLOTS:  # a padding row adds 0
            one = one * (tl.load(slots_ptr + token) >= 0).to(tl.int64)
        tl.atomic_add(counts_ptr + chosen_ids, one, mask=slots < top_k)


def moe_route(
    logits: torch.Tensor,  # [T, E]: the router's, in the model's dtype
    top_k: int,
    renormalize: bool,
    counts: torch.Tensor | None = None,  # [E] int64: each real token's choices added to it
    slots: torch.Tensor | None = None,  # [T]: the tokens' KV slots; < 0: padding
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] float32, expert ids [T, k] int64
    num_tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"routing needs 1 <= top_k ({top_k}) <= experts ({num_experts}) <= 1024")
    logits = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            logits, weights, ids, counts if counts is not None else ids,
            slots if slots is not None else ids, num_experts, top_k, logits.stride(0),
            RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k), COUNT=counts is not None,
            SLOTS=slots is not None,
        )  # fmt: skip
    return weights, ids


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
        blocks = start + lanes
        owner = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        owner = tl.where(owner < num_experts, owner, -1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < size // BLOCK_M)
    tl.debug_barrier()  # the empty slots are written before any pair's
    free = ends - padded  # each expert's next slot
    for start in range(0, num_pairs, CHUNK):
        pairs = start + lanes
        e = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
        mine = e[:, None] == experts[None, :]  # [CHUNK, BLOCK_E]
        base = tl.sum(tl.where(mine, free[None, :], 0), axis=1)
        earlier = (e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_ptr + base + rank, pairs, mask=pairs < num_pairs)
        free += tl.sum(mine.to(tl.int32), axis=0)


def align(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:  # sorted pairs [P] int32, block experts [P / BLOCK_M]
    """The pairs (token t's j-th choice is pair t * k + j) by expert, in pair order within
    an expert, each expert's group padded to block_m with the pair count (no pair), and each
    block's expert (-1 past the last group); P = aligned_size. Up to ALIGN_KERNEL_MAX_PAIRS
    pairs (a decode step's) one launch, past them the torch reference's dozen."""
    num_pairs = ids.numel()
    if num_pairs > ALIGN_KERNEL_MAX_PAIRS or num_experts > MAX_EXPERTS:
        return align_reference(ids, num_experts, block_m)
    size = aligned_size(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(size, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    block_e = triton.next_power_of_2(num_experts)
    _align_kernel[(1,)](
        ids.contiguous(), sorted_pairs, block_experts, num_pairs, num_experts, size,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=min(64, max(16, ALIGN_CHUNK_VALUES // block_e)),
    )  # fmt: skip
    return sorted_pairs, block_experts
