"""A mixture of experts' MLPs in Triton: grouped GEMMs over the (token, expert) pairs sorted by
expert, so that each expert's weights are read once per block of its tokens, and only the
chosen experts' weights are read at all. Same math as `kernels.moe.moe_experts_reference`.

1. `align`: the T * k pairs (token t's j-th choice is pair t * k + j) sorted by expert, each
   expert's group padded to a multiple of BLOCK_M, and each block's expert. All on the device
   and sized for the worst case (every group padded), so nothing waits for the host and a CUDA
   graph holds it.
2. `_gate_up_kernel`: per block of BLOCK_M pairs and BLOCK_N columns, x's rows times the block's
   expert's gate and up rows, SiLU-and-mul fused: [pairs, I].
3. `_down_kernel`: those rows times the expert's down projection, scaled by each pair's routing
   weight: [pairs, H] in float32; then each token's k rows are summed (no atomics: the sum's
   order is fixed).
Blocks past the last group have expert -1: their programs load nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_N = 64
_BLOCK_K = 64


def block_rows(num_pairs: int) -> int:
    """Pairs a program takes: 16 for a decode's few (most groups hold one or two pairs), 64
    for a prefill's many."""
    return 16 if num_pairs <= 1024 else 64


def align(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:  # sorted pairs [P] int32, block experts [P / BLOCK_M]
    """The pairs by expert, each expert's group padded to block_m with the pair count (no
    pair), and each block's expert (-1 past the last group). P = pairs + experts * (block_m -
    1), rounded up to block_m: the most any routing needs."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    group_end = torch.cumsum(padded, 0)  # [E]
    group_start = group_end - padded
    order = torch.argsort(flat, stable=True)  # pairs by expert
    expert = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=ids.device) - first_of_expert[expert]
    size = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((size,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[group_start[expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, size, block_m, device=ids.device)
    block_experts = torch.searchsorted(group_end, block_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_pairs, block_experts.to(torch.int32)


@triton.jit
def _block(
    sorted_ptr,
    block_expert_ptr,
    w_ptr,
    num_pairs,
    N,
    stride_we,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """This program's pairs (and which are real: a block past the groups, expert -1, holds
    none), its output columns (none for no expert: no weights read) and its expert's weights."""
    block, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < tl.where(expert >= 0, N, 0)
    w = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we
    return pairs, pairs < num_pairs, cols, cols_ok, w


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [E, 2N, K]: gate rows, then up rows
    out_ptr,  # [pairs, N]
    sorted_ptr,  # [P] int32
    block_expert_ptr,  # [P / BLOCK_M] int32
    num_pairs,
    top_k,
    K,
    N,
    stride_x,
    stride_we,
    stride_wn,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pairs, rows_ok, cols, cols_ok, w = _block(
        sorted_ptr, block_expert_ptr, w_ptr, num_pairs, N, stride_we, BLOCK_M, BLOCK_N
    )
    tokens = tl.where(rows_ok, pairs // top_k, 0)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        ks_ok = ks < K
        a = tl.load(
            x_ptr + tokens[:, None] * stride_x + ks[None, :],
            mask=rows_ok[:, None] & ks_ok[None, :],
            other=0.0,
        )
        w_mask = ks_ok[:, None] & cols_ok[None, :]
        w_gate = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w + (cols + N)[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        gate += tl.dot(a, w_gate)
        up += tl.dot(a, w_up)
    out = gate / (1.0 + tl.exp(-gate)) * up
    out_ptrs = out_ptr + pairs[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr,  # [pairs, K]
    w_ptr,  # [E, N, K]
    out_ptr,  # [pairs, N] float32
    weights_ptr,  # [pairs] float32: each pair's routing weight
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    K,
    N,
    stride_h,
    stride_we,
    stride_wn,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pairs, rows_ok, cols, cols_ok, w = _block(
        sorted_ptr, block_expert_ptr, w_ptr, num_pairs, N, stride_we, BLOCK_M, BLOCK_N
    )
    rows = tl.where(rows_ok, pairs, 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        ks_ok = ks < K
        a = tl.load(
            h_ptr + rows[:, None] * stride_h + ks[None, :],
            mask=rows_ok[:, None] & ks_ok[None, :],
            other=0.0,
        )
        w_tile = tl.load(
            w + cols[None, :] * stride_wn + ks[:, None],
            mask=ks_ok[:, None] & cols_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(a, w_tile)
    acc *= tl.load(weights_ptr + rows, mask=rows_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, acc, mask=rows_ok[:, None] & cols_ok[None, :])


def moe_experts(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2 I, H]
    down: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H], x's dtype
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = down.shape
    num_pairs = num_tokens * top_k
    block_m = block_rows(num_pairs)
    sorted_pairs, block_experts = align(ids, num_experts, block_m)
    x = x.contiguous()
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    grid = (block_experts.numel(), triton.cdiv(inter, _BLOCK_N))
    _gate_up_kernel[grid](
        x, gate_up, h, sorted_pairs, block_experts, num_pairs, top_k, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )  # fmt: skip
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    grid = (block_experts.numel(), triton.cdiv(hidden, _BLOCK_N))
    _down_kernel[grid](
        h, down, out, weights.float().contiguous(), sorted_pairs, block_experts, num_pairs,
        inter, hidden, h.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )  # fmt: skip
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
