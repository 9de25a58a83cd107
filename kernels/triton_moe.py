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
   weight: [pairs, H] in x's dtype; then each token's k rows are summed in float32 (no
   atomics: the sum's order is fixed).
Blocks past the last group have expert -1: their programs return at once.

A decode's few pairs among many experts (`uses_gemv`) take two GEMV kernels instead, with no
sorting: `_pair_gate_up_kernel` reads each pair's expert (a pair per program row, as in
kernels/triton_linear.py's fma variant) and `_token_down_kernel` sums a token's k experts'
down projections in its own program, in choice order, so the sum needs no launch of its own.
Two pairs on one expert read its weights twice, which is rare while pairs are few against
experts (8 of 128 at batch 1 for Qwen3-30B-A3B), and costs less than the sorting: 37 against
51 us a layer at one token on an H200 (`GemvTiles`, from sweeps/moe_gemv_sweep.py).

FP8 experts (`gate_up_scale`, `down_scale` given) are read as e4m3 bytes, widened to x's dtype
(exactly) and scaled per output row and group of `K / G` input columns in float32 at each K
step: weight-only, as the reference dequantizes them. A K step stays within one group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_moe_route import align
from kernels.triton_moe_tiles import DEFAULT_GEMV_TILES, GemvTiles, GroupedTiles, grouped_tiles
from kernels.triton_stages import launch_fitting


def uses_gemv(num_pairs: int, num_experts: int) -> bool:
    """Few pairs against the experts (at most a quarter): most experts chosen hold one pair."""
    return num_pairs * 4 <= num_experts


@triton.jit
def _block(
    sorted_ptr,
    block_expert_ptr,
    w_ptr,
    s_ptr,
    num_pairs,
    N,
    stride_we,
    stride_se,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """This program's pairs (and which are real), its output columns and its expert's weights
    and scales."""
    block, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < N
    return (
        pairs,
        pairs < num_pairs,
        cols,
        cols_ok,
        w_ptr + expert * stride_we,
        s_ptr + expert * stride_se,
    )


@triton.jit
def _scaled(acc, s, rows, rows_ok, start, scale_group, stride_sn, SCALED: tl.constexpr):
    """acc [.., BLOCK_N] (a K step's products) times its rows' scales for the step's group."""
    if SCALED:
        scale = tl.load(s + rows * stride_sn + start // scale_group, mask=rows_ok, other=0.0)
        return acc * scale[None, :]
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [E, 2N, K]: gate rows, then up rows
    s_ptr,  # [E, 2N, G] float32 with SCALED
    out_ptr,  # [pairs, N]
    sorted_ptr,  # [P] int32
    block_expert_ptr,  # [P / BLOCK_M] int32
    num_pairs,
    top_k,
    K,
    N,
    scale_group,  # K / G
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr,
):
    if tl.load(block_expert_ptr + tl.program_id(0)) < 0:
        return  # a block past the last group: no pairs
    pairs, rows_ok, cols, cols_ok, w, s = _block(
        sorted_ptr, block_expert_ptr, w_ptr, s_ptr, num_pairs, N, stride_we, stride_se,
        BLOCK_M, BLOCK_N,
    )  # fmt: skip
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
        g = tl.dot(a, w_gate.to(a.dtype))
        u = tl.dot(a, w_up.to(a.dtype))
        gate += _scaled(g, s, cols, cols_ok, start, scale_group, stride_sn, SCALED)
        up += _scaled(u, s, cols + N, cols_ok, start, scale_group, stride_sn, SCALED)
    out = gate / (1.0 + tl.exp(-gate)) * up
    out_ptrs = out_ptr + pairs[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr,  # [pairs, K]
    w_ptr,  # [E, N, K]
    s_ptr,  # [E, N, G] float32 with SCALED
    out_ptr,  # [pairs, N]
    weights_ptr,  # [pairs] float32: each pair's routing weight
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    K,
    N,
    scale_group,
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr,
):
    if tl.load(block_expert_ptr + tl.program_id(0)) < 0:
        return
    pairs, rows_ok, cols, cols_ok, w, s = _block(
        sorted_ptr, block_expert_ptr, w_ptr, s_ptr, num_pairs, N, stride_we, stride_se,
        BLOCK_M, BLOCK_N,
    )  # fmt: skip
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
        product = tl.dot(a, w_tile.to(a.dtype))
        acc += _scaled(product, s, cols, cols_ok, start, scale_group, stride_sn, SCALED)
    acc *= tl.load(weights_ptr + rows, mask=rows_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, out, mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit
def _row_scales(s, rows, rows_ok, start, scale_group, stride_sn, SCALED: tl.constexpr):
    """[BLOCK_N, 1]: the GEMV's rows' scales for the K step's group (1 without SCALED)."""
    if SCALED:
        scale = tl.load(s + rows * stride_sn + start // scale_group, mask=rows_ok, other=0.0)
        return scale[:, None]
    return 1.0


@triton.jit
def _pair_gate_up_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [E, 2N, K]
    s_ptr,  # [E, 2N, G] float32 with SCALED
    out_ptr,  # [pairs, N]
    ids_ptr,  # [pairs]: each pair's expert
    top_k,
    K,
    N,
    scale_group,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr,
):
    pair, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    w, s = w_ptr + expert * stride_we, s_ptr + expert * stride_se
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
        s_gate = _row_scales(s, cols, cols_ok, start, scale_group, stride_sn, SCALED)
        s_up = _row_scales(s, cols + N, cols_ok, start, scale_group, stride_sn, SCALED)
        gate += w_gate.to(tl.float32) * s_gate * a
        up += w_up.to(tl.float32) * s_up * a
    g, u = tl.sum(gate, axis=1), tl.sum(up, axis=1)
    out = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + pair * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=cols_ok)


@triton.jit
def _token_down_kernel(
    h_ptr,  # [pairs, K]
    w_ptr,  # [E, N, K]
    s_ptr,  # [E, N, G] float32 with SCALED
    out_ptr,  # [T, N]
    weights_ptr,  # [pairs] float32
    ids_ptr,  # [pairs]
    top_k,
    K,
    N,
    scale_group,
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr,
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
        start = (step % chunks) * BLOCK_K
        ks = start + tl.arange(0, BLOCK_K)
        ks_ok = ks < K
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        w, s = w_ptr + expert * stride_we, s_ptr + expert * stride_se
        a = tl.load(h_ptr + pair.to(tl.int64) * stride_h + ks, mask=ks_ok, other=0.0)
        a = a.to(tl.float32) * tl.load(weights_ptr + pair)
        mask = cols_ok[:, None] & ks_ok[None, :]
        w_tile = tl.load(w + cols[:, None] * stride_wn + ks[None, :], mask=mask, other=0.0)
        scale = _row_scales(s, cols, cols_ok, start, scale_group, stride_sn, SCALED)
        acc += w_tile.to(tl.float32) * scale * a[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + token * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=cols_ok)


class Scales:
    """An expert tensor's FP8 scales as the kernels take them: the tensor (a float32 dummy
    without), its strides, the columns a group spans, and the K step that stays within one."""

    def __init__(self, scale: torch.Tensor | None, weight: torch.Tensor, block_k: int) -> None:
        k = weight.shape[2]
        self.scaled = scale is not None
        self.tensor = scale if scale is not None else weight.new_empty(1, dtype=torch.float32)
        self.group = k // scale.shape[2] if scale is not None else k
        self.strides = (self.tensor.stride(0), self.tensor.stride(1)) if self.scaled else (0, 0)
        self.block_k = block_k
        if self.scaled and self.group < k:  # a step within one group: a power of two dividing it
            self.block_k = min(block_k, self.group & -self.group)


def moe_experts_gemv(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tiles: GemvTiles = DEFAULT_GEMV_TILES,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """moe_experts for few pairs: two launches, no sorting (see the module's docstring)."""
    num_tokens, top_k = ids.shape
    hidden, inter = down.shape[1:]
    ids = ids.contiguous()
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    up = Scales(gate_up_scale, gate_up, tiles.gate_up_k)
    grid = (num_tokens * top_k, triton.cdiv(inter, tiles.gate_up_n))
    _pair_gate_up_kernel[grid](
        x, gate_up, up.tensor, h, ids, top_k, hidden, inter, up.group,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), *up.strides, h.stride(0),
        BLOCK_N=tiles.gate_up_n, BLOCK_K=up.block_k, SCALED=up.scaled,
        num_warps=tiles.num_warps,
    )  # fmt: skip
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    dn = Scales(down_scale, down, tiles.down_k)
    grid = (num_tokens, triton.cdiv(hidden, tiles.down_n))
    _token_down_kernel[grid](
        h, down, dn.tensor, out, weights.float().contiguous(), ids, top_k, inter, hidden,
        dn.group, h.stride(0), down.stride(0), down.stride(1), *dn.strides, out.stride(0),
        BLOCK_N=tiles.down_n, BLOCK_K=dn.block_k, SCALED=dn.scaled, num_warps=tiles.num_warps,
    )  # fmt: skip
    return out


def moe_experts(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2 I, H]
    down: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k]
    gate_up_scale: torch.Tensor | None = None,  # [E, 2 I, G] float32: FP8 experts
    down_scale: torch.Tensor | None = None,  # [E, H, G'] float32
) -> torch.Tensor:  # [T, H], x's dtype
    x = x.contiguous()
    scales = {"gate_up_scale": gate_up_scale, "down_scale": down_scale}
    if uses_gemv(ids.numel(), down.shape[0]):
        return moe_experts_gemv(x, gate_up, down, weights, ids, **scales)
    return moe_experts_grouped(x, gate_up, down, weights, ids, **scales)


def moe_experts_grouped(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tiles: GroupedTiles | None = None,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """moe_experts over the pairs sorted by expert (see the module's docstring); `tiles`:
    by the pair count (kernels/triton_moe_tiles.py) unless given."""
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = down.shape
    num_pairs = num_tokens * top_k
    tiles = tiles or grouped_tiles(num_pairs)
    sorted_pairs, block_experts = align(ids, num_experts, tiles.block_m)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    up, up_scales = tiles.gate_up, Scales(gate_up_scale, gate_up, tiles.gate_up.k)
    grid = (block_experts.numel(), triton.cdiv(inter, up.n))
    args = (
        x, gate_up, up_scales.tensor, h, sorted_pairs, block_experts, num_pairs, top_k, hidden,
        inter, up_scales.group, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        *up_scales.strides, h.stride(0),
    )  # fmt: skip
    constants = dict(BLOCK_M=tiles.block_m, BLOCK_N=up.n, BLOCK_K=up_scales.block_k,
                     SCALED=up_scales.scaled, num_warps=up.num_warps)  # fmt: skip
    _launch(_gate_up_kernel, grid, args, constants, up.num_stages, x)
    # Each pair's row in x's dtype (half the bytes of float32, as vLLM's), summed in float32.
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    dn, dn_scales = tiles.down, Scales(down_scale, down, tiles.down.k)
    grid = (block_experts.numel(), triton.cdiv(hidden, dn.n))
    args = (
        h, down, dn_scales.tensor, out, weights.float().contiguous(), sorted_pairs,
        block_experts, num_pairs, inter, hidden, dn_scales.group, h.stride(0), down.stride(0),
        down.stride(1), *dn_scales.strides, out.stride(0),
    )  # fmt: skip
    constants = dict(BLOCK_M=tiles.block_m, BLOCK_N=dn.n, BLOCK_K=dn_scales.block_k,
                     SCALED=dn_scales.scaled, num_warps=dn.num_warps)  # fmt: skip
    _launch(_down_kernel, grid, args, constants, dn.num_stages, x)
    return out.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


def _launch(
    kernel: triton.JITFunction,
    grid: tuple[int, int],
    args: tuple[object, ...],
    constants: dict[str, object],
    num_stages: int,
    x: torch.Tensor,
) -> None:
    """A grouped GEMM's launch, with fewer pipeline stages where the GPU lacks the shared
    memory for the tiles' (kernels/triton_stages.py)."""
    variant = (kernel.__name__, x.device, x.dtype, args[1].dtype, *constants.values())  # type: ignore[attr-defined]
    launch_fitting(
        variant, num_stages, lambda stages: kernel[grid](*args, **constants, num_stages=stages)
    )
