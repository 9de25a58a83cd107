"""A mixture of experts' routing in one Triton launch: per token, the router's logits to the
top k experts and their weights. Same math as `kernels.moe.moe_route_reference`. The pairs'
sort by expert that follows is kernels/triton_moe_align.py's.

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

MAX_EXPERTS = 1024  # a row of logits held in one program's registers


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
