"""A mixture of experts: each token routed to its top-k experts, and the experts' gated MLPs
summed by the routing weights (Qwen3-MoE, Mixtral; shared/model_config.MoeConfig).

These are the plain-torch references. Neither syncs with the host (ids stay on the device),
so a CUDA graph can hold them; the experts' reference runs every expert over every token, E
times the work of the chosen ones, until the grouped-GEMM kernel replaces it on the GPU.

An expert id of -1 is a choice another rank runs (expert parallelism, services/executor/
layers/moe.py): the pair adds nothing here, and no kernel reads weights for it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.activation import silu_and_mul_reference
from kernels.fp8 import (
    dequantize_fp8_groupwise,
    quantize_fp8_groupwise_reference,
    quantize_fp8_rowwise_reference,
)
from kernels.int4 import Int4Stack
from kernels.mxfp4 import dequantize_4bit_stack


class ExpertBiases(NamedTuple):
    """gpt-oss's: each expert's gate/up and down projections' biases."""

    gate_up: torch.Tensor  # [E, 2 I]: the gate's, then the up's
    down: torch.Tensor  # [E, H]


class ClampedSwiglu(NamedTuple):
    """gpt-oss's activation of an expert's gate and up rows, in place of silu(gate) * up:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g) with g = clamp(gate, max=limit)."""

    limit: float
    alpha: float = 1.702


def clamped_swiglu_reference(gate_up: torch.Tensor, swiglu: ClampedSwiglu) -> torch.Tensor:
    """[.., 2 I] (gate, then up) -> [.., I], in float32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=swiglu.limit)
    up = up.clamp(-swiglu.limit, swiglu.limit)
    return (up + 1) * gate * torch.sigmoid(swiglu.alpha * gate)


def sum_chosen_reference(
    rows: torch.Tensor,  # [T k, H]: each (token, choice) pair's row, a token's k together
    ids: torch.Tensor,  # [T, k]: each pair's expert; -1: another rank's, its row never written
) -> torch.Tensor:  # [T, H], rows' dtype
    """Each token's rows of the choices made here (expert >= 0) summed in float32 and rounded
    once; the other rows are not read (whatever they hold, NaN included)."""
    chosen = (ids >= 0)[..., None]
    by_token = rows.view(*ids.shape, rows.shape[1]).float()
    return torch.where(chosen, by_token, 0.0).sum(dim=1).to(rows.dtype)


def own_pairs(num_pairs: int, experts: int, all_experts: int | None) -> int:
    """About how many of `num_pairs` (every rank's tokens' choices) fall on this rank's
    `experts` of `all_experts` (None: this rank holds them all): what the expert kernels weigh
    in choosing GEMVs or grouped GEMMs, since other ranks' choices (-1) cost them nothing."""
    return num_pairs * experts // (all_experts or experts)


def aligned_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Slots for the pairs sorted by expert, each expert's group padded to block_m: the most
    any routing needs (every group one pair past a multiple), rounded up to block_m."""
    return -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m


def align_reference(
    ids: torch.Tensor,  # [T, k]: each (token, choice) pair's expert
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # sorted pairs [P] int32, block experts [P / block_m]
    """The pairs (token t's j-th choice is pair t * k + j) sorted by expert, in pair order
    within an expert, each expert's group padded to block_m with the pair count (no pair),
    and each block's expert (-1 past the last group); P = aligned_size. Pairs of expert -1
    (another rank's) are left out. What the grouped GEMMs read (kernels/triton_moe.py)."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    here = flat >= 0
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat.clamp(min=0), here.to(torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    group_end = torch.cumsum(padded, 0)  # [E]
    group_start = group_end - padded
    order = torch.argsort(flat, stable=True)  # pairs by expert, another rank's (-1) first
    expert = flat[order].clamp(min=0)
    first_of_expert = torch.cumsum(counts, 0) - counts + (num_pairs - counts.sum())
    rank = torch.arange(num_pairs, device=ids.device) - first_of_expert[expert]
    size = aligned_size(num_pairs, num_experts, block_m)
    # One slot past the end takes another rank's pairs, and is dropped.
    sorted_pairs = torch.full((size + 1,), num_pairs, dtype=torch.int32, device=ids.device)
    slots = torch.where(here[order], group_start[expert] + rank, size)
    sorted_pairs[slots] = order.to(torch.int32)
    sorted_pairs = sorted_pairs[:size]
    block_start = torch.arange(0, size, block_m, device=ids.device)
    block_experts = torch.searchsorted(group_end, block_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_pairs, block_experts.to(torch.int32)


def moe_route_reference(
    logits: torch.Tensor,  # [T, E]: the router's, in the model's dtype
    top_k: int,
    renormalize: bool,  # rescale the chosen experts' probabilities to sum to 1
    counts: torch.Tensor | None = None,  # [E] int64: each expert's choices, added to in place
    slots: torch.Tensor | None = None,  # [T]: the tokens' KV slots; < 0: padding, not counted
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] float32, expert ids [T, k] int64
    """Softmax over all experts in float32, then the top k (as transformers routes); with
    `counts`, each real token's choices counted into it."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if counts is not None:
        real = torch.ones_like(ids) if slots is None else (slots[:, None] >= 0).expand_as(ids)
        counts.index_add_(0, ids.flatten(), real.flatten().to(counts.dtype))
    return weights, ids


def dequantize_experts(
    weight: torch.Tensor,  # [E, N, K]: float8_e4m3fn
    scale: torch.Tensor,  # [E, N, G] float32: per output row and group of K / G columns
) -> torch.Tensor:  # [E, N, K] float32
    """FP8 experts as their float weights, q * scale."""
    group = weight.shape[2] // scale.shape[2]
    return weight.float() * scale.repeat_interleave(group, dim=2)


def fp8_inputs_reference(
    x: torch.Tensor,  # [R, C]
    groups: int,  # scales a row: 1 (per row), or one per C / groups columns
) -> tuple[torch.Tensor, torch.Tensor]:  # ([R, C] float8_e4m3fn, [R, groups] float32)
    """An FP8 expert's input quantized as its weight is scaled: per row, or per row and
    group of the same columns."""
    if groups == 1:
        return quantize_fp8_rowwise_reference(x)
    return quantize_fp8_groupwise_reference(x, x.shape[1] // groups)


def _fp8_rounded(x: torch.Tensor, groups: int) -> torch.Tensor:  # [R, C] float32
    return dequantize_fp8_groupwise(*fp8_inputs_reference(x, groups))


def moe_experts_reference(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2 I, H]: each expert's gate rows, then its up rows
    down: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k] int
    gate_up_scale: torch.Tensor | None = None,  # [E, 2 I, G] float32: FP8 experts
    down_scale: torch.Tensor | None = None,  # [E, H, G'] float32
    biases: ExpertBiases | None = None,
    swiglu: ClampedSwiglu | None = None,  # None: silu(gate) * up
) -> torch.Tensor:  # [T, H], x's dtype
    """sum over a token's k experts e of weight * down_e(silu(gate_e x) * up_e x), summed in
    float32 in ascending expert order; a choice of expert -1 adds nothing. FP8 experts are
    W8A8: each projection's input is rounded to e4m3 per row (or per row and group, as its
    weight's scales go), and both operands are dequantized, in float32; silu(..) * up is
    rounded to x's dtype first, as the kernels store it. gpt-oss's: each projection plus its
    bias, its activation `swiglu`."""
    x_in, down_groups = x, 0  # down_groups: the SiLU rows' rounding (0: none)
    if gate_up_scale is not None and down_scale is not None:
        x_in, down_groups = _fp8_rounded(x, gate_up_scale.shape[2]), down_scale.shape[2]
        gate_up = dequantize_experts(gate_up, gate_up_scale)
        down = dequantize_experts(down, down_scale)
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        share = (weights * (ids == expert)).sum(dim=-1)  # [T]: 0 where not chosen
        projected = x_in @ gate_up[expert].T  # [T, 2 I]
        if biases is not None:
            projected = projected + biases.gate_up[expert]
        if swiglu is not None:
            hidden = clamped_swiglu_reference(projected, swiglu).to(x.dtype)  # [T, I]
        else:
            hidden = silu_and_mul_reference(projected)
        if down_groups:
            hidden = _fp8_rounded(hidden.to(x.dtype), down_groups)
        rows = (hidden @ down[expert].T).float()
        if biases is not None:
            rows = rows + biases.down[expert].float()
        out += share[:, None] * rows
    return out.to(x.dtype)


def moe_experts_int4_reference(
    x: torch.Tensor,  # [T, H]
    gate_up: Int4Stack,  # [E, 2 I, H]: each expert's gate rows, then its up rows
    down: Int4Stack,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k] int
    biases: ExpertBiases | None = None,  # gpt-oss's
    swiglu: ClampedSwiglu | None = None,
) -> torch.Tensor:  # [T, H], x's dtype
    """int4 (or MXFP4) experts, W4A16: each expert's weights dequantized and rounded to x's
    dtype (as kernels/int4.py's reference), then moe_experts_reference."""
    gate_up_weight = dequantize_4bit_stack(gate_up, x.dtype)
    down_weight = dequantize_4bit_stack(down, x.dtype)
    return moe_experts_reference(
        x, gate_up_weight, down_weight, weights, ids, biases=biases, swiglu=swiglu
    )
