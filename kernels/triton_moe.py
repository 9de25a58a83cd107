"""A mixture of experts' MLPs in Triton: grouped GEMMs over the (token, expert) pairs sorted by
expert, so that each expert's weights are read once per block of its tokens, and only the
chosen experts' weights are read at all. Same math as `kernels.moe.moe_experts_reference`.

1. `align` (kernels/triton_moe_route.py): the T * k pairs (token t's j-th choice is pair
   t * k + j) sorted by expert, each expert's group padded to a multiple of BLOCK_M, and each
   block's expert. All on the device and sized for the worst case (every group padded), so
   nothing waits for the host and a CUDA graph holds it.
2. `_gate_up_kernel`: per block of BLOCK_M pairs and BLOCK_N columns, x's rows times the block's
   expert's gate and up rows, SiLU-and-mul fused: [pairs, I].
3. `_down_kernel`: those rows times the expert's down projection, scaled by each pair's routing
   weight: [pairs, H] in float32; then each token's k rows are summed (no atomics: the sum's
   order is fixed).
Blocks past the last group have expert -1: their programs return at once.

A decode's few pairs among many experts (`uses_gemv`) take two GEMV kernels instead, with no
sorting: `_pair_gate_up_kernel` reads each pair's expert (a pair per program row, as in
kernels/triton_linear.py's fma variant) and `_token_down_kernel` sums a token's k experts'
down projections in its own program, in choice order, so the sum needs no launch of its own.
Two pairs on one expert read its weights twice, which is rare while pairs are few against
experts (8 of 128 at batch 1 for Qwen3-30B-A3B), and costs less than the sorting: 37 against
51 us a layer at one token on an H200 (`GemvTiles`, from sweeps/moe_gemv_sweep.py).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.triton_moe_route import align

_BLOCK_N = 64
_BLOCK_K = 64


def uses_gemv(num_pairs: int, num_experts: int) -> bool:
    """Few pairs against the experts (at most a quarter): most experts chosen hold one pair."""
    return num_pairs * 4 <= num_experts


def block_rows(num_pairs: int) -> int:
    """Pairs a program takes: 16 for a decode's few (most groups hold one or two pairs), 64
    for a prefill's many."""
    return 16 if num_pairs <= 1024 else 64


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
    """This program's pairs (and which are real), its output columns and its expert's weights."""
    block, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < N
    w = w_ptr + expert.to(tl.int64) * stride_we
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
    if tl.load(block_expert_ptr + tl.program_id(0)) < 0:
        return  # a block past the last group: no pairs
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
    if tl.load(block_expert_ptr + tl.program_id(0)) < 0:
        return
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


@triton.jit
def _pair_gate_up_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [E, 2N, K]
    out_ptr,  # [pairs, N]
    ids_ptr,  # [pairs]: each pair's expert
    top_k,
    K,
    N,
    stride_x,
    stride_we,
    stride_wn,
    stride_out,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair, tile = tl.program_id(0), tl.program_id(1)
    w = w_ptr + tl.load(ids_ptr + pair).to(tl.int64) * stride_we
    x = x_ptr + (pair // top_k).to(tl.int64) * stride_x
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < N
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        ks_ok = ks < K
        a = tl.load(x + ks, mask=ks_ok, other=0.0).to(tl.float32)[None, :]
        mask = cols_ok[:, None] & ks_ok[None, :]
        w_gate = tl.load(w + cols[:, None] * stride_wn + ks[None, :], mask=mask, other=0.0)
        w_up = tl.load(w + (cols + N)[:, None] * stride_wn + ks[None, :], mask=mask, other=0.0)
        gate += w_gate.to(tl.float32) * a
        up += w_up.to(tl.float32) * a
    g, u = tl.sum(gate, axis=1), tl.sum(up, axis=1)
    out = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + pair * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=cols_ok)


@triton.jit
def _token_down_kernel(
    h_ptr,  # [pairs, K]
    w_ptr,  # [E, N, K]
    out_ptr,  # [T, N]
    weights_ptr,  # [pairs] float32
    ids_ptr,  # [pairs]
    top_k,
    K,
    N,
    stride_h,
    stride_we,
    stride_wn,
    stride_out,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One GEMV over the token's k experts' down rows side by side (K' = k * K), each pair's
    row scaled by its weight: one loop, so loads stay in flight across experts."""
    token, tile = tl.program_id(0), tl.program_id(1)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < N
    chunks = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for step in range(top_k * chunks):
        pair = token * top_k + step // chunks
        ks = (step % chunks) * BLOCK_K + tl.arange(0, BLOCK_K)
        ks_ok = ks < K
        w = w_ptr + tl.load(ids_ptr + pair).to(tl.int64) * stride_we
        a = tl.load(h_ptr + pair.to(tl.int64) * stride_h + ks, mask=ks_ok, other=0.0)
        a = a.to(tl.float32) * tl.load(weights_ptr + pair)
        mask = cols_ok[:, None] & ks_ok[None, :]
        w_tile = tl.load(w + cols[:, None] * stride_wn + ks[None, :], mask=mask, other=0.0)
        acc += w_tile.to(tl.float32) * a[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + token * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=cols_ok)


@dataclasses.dataclass(frozen=True)
class GemvTiles:
    """The GEMV kernels' tiles: output columns and K a program step (powers of two), warps."""

    gate_up_n: int = 16
    gate_up_k: int = 256
    down_n: int = 4
    down_k: int = 512
    num_warps: int = 4


def moe_experts_gemv(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tiles: GemvTiles = GemvTiles(),
) -> torch.Tensor:
    """moe_experts for few pairs: two launches, no sorting (see the module's docstring)."""
    num_tokens, top_k = ids.shape
    hidden, inter = down.shape[1:]
    ids = ids.contiguous()
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    grid = (num_tokens * top_k, triton.cdiv(inter, tiles.gate_up_n))
    _pair_gate_up_kernel[grid](
        x, gate_up, h, ids, top_k, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        BLOCK_N=tiles.gate_up_n, BLOCK_K=tiles.gate_up_k, num_warps=tiles.num_warps,
    )  # fmt: skip
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    grid = (num_tokens, triton.cdiv(hidden, tiles.down_n))
    _token_down_kernel[grid](
        h, down, out, weights.float().contiguous(), ids, top_k, inter, hidden,
        h.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_N=tiles.down_n, BLOCK_K=tiles.down_k, num_warps=tiles.num_warps,
    )  # fmt: skip
    return out


def moe_experts(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2 I, H]
    down: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H], x's dtype
    x = x.contiguous()
    if uses_gemv(ids.numel(), down.shape[0]):
        return moe_experts_gemv(x, gate_up, down, weights, ids)
    return moe_experts_grouped(x, gate_up, down, weights, ids)


def moe_experts_grouped(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """moe_experts over the pairs sorted by expert (see the module's docstring)."""
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = down.shape
    num_pairs = num_tokens * top_k
    block_m = block_rows(num_pairs)
    sorted_pairs, block_experts = align(ids, num_experts, block_m)
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
