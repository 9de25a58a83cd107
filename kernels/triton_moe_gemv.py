"""A decode's few (token, expert) pairs among many experts (kernels/triton_moe.py `uses_gemv`):
two GEMV kernels with no sorting. `_pair_gate_up_kernel` reads each pair's expert (a pair per
program row, as in kernels/triton_linear.py's fma variant) and `_token_down_kernel` sums a
token's k experts' down projections in its own program, in choice order, so the sum needs no
launch of its own. Two pairs on one expert read its weights twice, which is rare while pairs
are few against experts (8 of 128 at batch 1 for Qwen3-30B-A3B), and costs less than the
sorting: 37 against 51 us a layer at one token on an H200 (`GemvTiles`, from
sweeps/moe_gemv_sweep.py).

FP8 experts (MODE 1: a scale per weight row; MODE 2: per row and group of GROUP columns, the
K step then one group) round each input to e4m3 as the reference does (per row, or per group)
inside the kernel, from its amax: a decode's inputs are a few rows, so no launch of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe import ClampedSwiglu, ExpertBiases
from kernels.triton_e4m3 import scale_for, to_e4m3
from kernels.triton_moe_tiles import DEFAULT_GEMV_TILES, FP8_GEMV_TILES, GemvTiles

# The most values a program loads at once to find its input rows' e4m3 scales: a few loads
# in flight, not one a K step a row, before the weights' loop can start (an FP8 down GEMV
# took 22.8 us at one token on an H100, its bf16 twin 14.7, reading twice the bytes).
# Compiled for sm_90 at Qwen3-30B-A3B's shape (bf16's tiles), the down GEMV takes 64 registers a
# thread with 4,096 (two loads of 8 rows), 102 with 8,192 (one), 56 with a load a row and K step.
SCALE_LOAD = 4096


@triton.jit
def _rows_scales(rows_ptr, num_rows, K, stride, ROWS: tl.constexpr, SCALE_K: tl.constexpr):
    """The e4m3 scales (amax / 448) of `num_rows` rows of K values, `stride` apart, as
    [ROWS] (ROWS >= num_rows; 1.0 past them), SCALE_K columns of every row a load."""
    rows = tl.arange(0, ROWS)
    starts = rows_ptr + rows.to(tl.int64)[:, None] * stride
    amax = tl.zeros((ROWS, SCALE_K), dtype=tl.float32)
    for start in range(0, K, SCALE_K):
        ks = start + tl.arange(0, SCALE_K)
        mask = (rows < num_rows)[:, None] & (ks < K)[None, :]
        values = tl.load(starts + ks[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.abs(values.to(tl.float32)))
    return tl.where(rows < num_rows, scale_for(tl.max(amax, axis=1)), 1.0)


@triton.jit
def _input_step(a, scale, MODE: tl.constexpr):
    """A K step of an input row: as is (MODE 0), rounded to e4m3 by the row's scale (1; the
    scale is applied after the sum), or by its group's, which the step is (2)."""
    if MODE == 1:
        a = to_e4m3(a / scale)
    elif MODE == 2:
        group_scale = scale_for(tl.max(tl.abs(a), axis=0))
        a = to_e4m3(a / group_scale) * group_scale
    return a


@triton.jit
def _weight_step(w, s, rows, rows_ok, start, group, stride_sn, MODE: tl.constexpr):
    """A weight tile [BLOCK_N, BLOCK_K] in float32; in MODE 2 times its rows' scales for
    the step's group."""
    w = w.to(tl.float32)
    if MODE == 2:
        scale = tl.load(s + rows * stride_sn + start // group, mask=rows_ok, other=0.0)
        w = w * scale[:, None]
    return w


@triton.jit
def expert_activation(gate, up, bias_row, cols, cols_ok, N, limit, alpha,
                      HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):  # fmt: skip
    """An expert's hidden values from its gate and up sums (float32, the columns last):
    silu(gate) * up; with gpt-oss's biases (bias_row: the expert's [2N], gate's then up's)
    added first, and with SWIGLU its clamped SwiGLU (kernels.moe.ClampedSwiglu)."""
    if HAS_BIAS:
        gate += tl.load(bias_row + cols, mask=cols_ok, other=0.0).to(tl.float32)
        up += tl.load(bias_row + N + cols, mask=cols_ok, other=0.0).to(tl.float32)
    if SWIGLU:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _pair_gate_up_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [E, 2N, K]
    s_ptr,  # [E, 2N, G] float32 with MODE > 0
    out_ptr,  # [pairs, N]
    ids_ptr,  # [pairs]: each pair's expert
    top_k,
    K,
    N,
    group,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    bias_ptr,  # [E, 2N] with HAS_BIAS
    limit,  # with SWIGLU
    alpha,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_K: tl.constexpr,  # with MODE 1: the columns a load of the input row's scale takes
    MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    pair, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < N
    if expert < 0:  # another rank's expert: a row of zeros (the down GEMV reads no weights for it)
        zeros = tl.zeros((BLOCK_N,), dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + pair * stride_out + cols, zeros, mask=cols_ok)
        return
    w, s = w_ptr + expert * stride_we, s_ptr + expert * stride_se
    x = x_ptr + (pair // top_k).to(tl.int64) * stride_x
    x_scale = 1.0
    if MODE == 1:
        x_scale = tl.sum(_rows_scales(x, 1, K, stride_x, 1, SCALE_K), axis=0)
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        ks_ok = ks < K
        a = _input_step(tl.load(x + ks, mask=ks_ok, other=0.0).to(tl.float32), x_scale, MODE)
        mask = cols_ok[:, None] & ks_ok[None, :]
        w_gate = tl.load(w + cols[:, None] * stride_wn + ks[None, :], mask=mask, other=0.0)
        w_up = tl.load(w + (cols + N)[:, None] * stride_wn + ks[None, :], mask=mask, other=0.0)
        gate += _weight_step(w_gate, s, cols, cols_ok, start, group, stride_sn, MODE) * a[None, :]
        up += _weight_step(w_up, s, cols + N, cols_ok, start, group, stride_sn, MODE) * a[None, :]
    g, u = tl.sum(gate, axis=1), tl.sum(up, axis=1)
    if MODE == 1:  # the weight rows' scales and the input's, after the sum
        g *= x_scale * tl.load(s + cols * stride_sn, mask=cols_ok, other=0.0)
        u *= x_scale * tl.load(s + (cols + N) * stride_sn, mask=cols_ok, other=0.0)
    bias_row = bias_ptr + expert * 2 * N
    out = expert_activation(g, u, bias_row, cols, cols_ok, N, limit, alpha, HAS_BIAS, SWIGLU)
    tl.store(out_ptr + pair * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=cols_ok)


@triton.jit
def _token_down_kernel(
    h_ptr,  # [pairs, K]
    w_ptr,  # [E, N, K]
    s_ptr,  # [E, N, G] float32 with MODE > 0
    out_ptr,  # [T, N]
    weights_ptr,  # [pairs] float32
    ids_ptr,  # [pairs]
    top_k,
    K,
    N,
    group,
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    bias_ptr,  # [E, N] with HAS_BIAS
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_TOP_K: tl.constexpr,  # top_k's next power of two
    SCALE_K: tl.constexpr,  # with MODE 1: the columns of each of the k rows a load takes
    MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """One GEMV over the token's k experts' down rows side by side (K' = k * K), each pair's
    row scaled by its routing weight (and in MODE 1 by its rows' and input's scales): one
    loop, so loads stay in flight across experts. In MODE 1 the k rows' input scales are
    worked out first, each row read once for them. A pair of another rank's expert (-1) has
    a row of zeros and reads no weights. In MODE 1 the k rows' scales come first, from loads
    of SCALE_K columns of every row at once."""
    token, tile = tl.program_id(0), tl.program_id(1)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < N
    chunks = tl.cdiv(K, BLOCK_K)
    choices = tl.arange(0, BLOCK_TOP_K)
    h_scales = tl.full((BLOCK_TOP_K,), 1.0, tl.float32)
    if MODE == 1:
        rows = h_ptr + (token * top_k).to(tl.int64) * stride_h
        h_scales = _rows_scales(rows, top_k, K, stride_h, BLOCK_TOP_K, SCALE_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    biased = tl.zeros((BLOCK_N,), dtype=tl.float32)  # each pair's bias times its weight
    for step in range(top_k * chunks):
        choice = step // chunks
        pair = token * top_k + choice
        start = (step % chunks) * BLOCK_K
        ks = start + tl.arange(0, BLOCK_K)
        ks_ok = ks < K
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        here = cols < tl.where(expert >= 0, N, 0)  # the columns to read of its expert
        expert = tl.maximum(expert, 0)
        w, s = w_ptr + expert * stride_we, s_ptr + expert * stride_se
        h = h_ptr + pair.to(tl.int64) * stride_h
        scale = tl.load(weights_ptr + pair)
        h_scale = tl.sum(tl.where(choices == choice, h_scales, 0.0), axis=0)
        a = _input_step(tl.load(h + ks, mask=ks_ok, other=0.0).to(tl.float32), h_scale, MODE)
        mask = here[:, None] & ks_ok[None, :]
        w_tile = tl.load(w + cols[:, None] * stride_wn + ks[None, :], mask=mask, other=0.0)
        w_tile = _weight_step(w_tile, s, cols, here, start, group, stride_sn, MODE)
        if MODE == 1:
            w_rows = tl.load(s + cols * stride_sn, mask=here, other=0.0)
            w_tile = w_tile * (w_rows * h_scale)[:, None]
        acc += w_tile * (a * scale)[None, :]
        if HAS_BIAS:  # once a pair, at its first step
            bias = tl.load(bias_ptr + expert * N + cols, mask=here, other=0.0).to(tl.float32)
            biased += tl.where(step % chunks == 0, bias * scale, 0.0)
    out = tl.sum(acc, axis=1) + biased
    tl.store(out_ptr + token * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=cols_ok)


def moe_experts_gemv(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tiles: GemvTiles | None = None,  # by the experts' format unless given
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    biases: ExpertBiases | None = None,
    swiglu: ClampedSwiglu | None = None,
) -> torch.Tensor:
    """moe_experts for few pairs: two launches, no sorting (see the module's docstring)."""
    if tiles is None:
        tiles = DEFAULT_GEMV_TILES if gate_up_scale is None else FP8_GEMV_TILES
    num_tokens, top_k = ids.shape
    hidden, inter = down.shape[1:]
    ids = ids.contiguous()
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    up = WeightScales(gate_up_scale, gate_up, tiles.gate_up_k)
    grid = (num_tokens * top_k, triton.cdiv(inter, tiles.gate_up_n))
    _pair_gate_up_kernel[grid](
        x, gate_up, up.tensor, h, ids, top_k, hidden, inter, up.group,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), *up.strides, h.stride(0),
        *epilogue(biases, swiglu, x, "gate_up"),
        BLOCK_N=tiles.gate_up_n, BLOCK_K=up.block_k, SCALE_K=scale_columns(hidden, 1),
        MODE=up.mode, num_warps=tiles.num_warps, HAS_BIAS=biases is not None,
        SWIGLU=swiglu is not None,
    )  # fmt: skip
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    dn = WeightScales(down_scale, down, tiles.down_k)
    grid = (num_tokens, triton.cdiv(hidden, tiles.down_n))
    _token_down_kernel[grid](
        h, down, dn.tensor, out, weights.float().contiguous(), ids, top_k, inter, hidden,
        dn.group, h.stride(0), down.stride(0), down.stride(1), *dn.strides, out.stride(0),
        epilogue(biases, swiglu, x, "down")[0],
        BLOCK_N=tiles.down_n, BLOCK_K=dn.block_k, BLOCK_TOP_K=triton.next_power_of_2(top_k),
        SCALE_K=scale_columns(inter, top_k), MODE=dn.mode, num_warps=tiles.num_warps,
        HAS_BIAS=biases is not None,
    )  # fmt: skip
    return out


def scale_columns(k: int, rows: int) -> int:
    """The columns of each of `rows` input rows of k values that one load of their e4m3
    scales takes: all of them, up to SCALE_LOAD values in all."""
    return max(16, min(triton.next_power_of_2(k), SCALE_LOAD // triton.next_power_of_2(rows)))


def epilogue(
    biases: ExpertBiases | None, swiglu: ClampedSwiglu | None, x: torch.Tensor, which: str
) -> tuple[object, float, float]:
    """gpt-oss's additions to a kernel's end: the projection's biases (contiguous, [E, 2N] or
    [E, N]; x stands in without), the SwiGLU's limit and alpha (0 without)."""
    bias = getattr(biases, which).contiguous() if biases is not None else x
    return bias, (swiglu.limit if swiglu else 0.0), (swiglu.alpha if swiglu else 0.0)


class WeightScales:
    """An expert tensor's FP8 scales as the kernels take them: the tensor (a float32 dummy
    without), its strides, the columns a group spans, the mode (0: float weights, 1: a scale
    a row, 2: a scale a row and group) and the K step: in mode 2 a group's, so that the step
    is one group (the GEMV rounds its input by the step), at most `block_k` elsewhere."""

    def __init__(
        self, scale: torch.Tensor | None, weight: torch.Tensor, block_k: int, exact: bool = True
    ) -> None:
        k = weight.shape[2]
        groups = scale.shape[2] if scale is not None else 1
        self.mode = 0 if scale is None else (1 if groups == 1 else 2)
        self.tensor = scale if scale is not None else weight.new_empty(1, dtype=torch.float32)
        self.group = k // groups
        self.strides = (
            (self.tensor.stride(0), self.tensor.stride(1)) if scale is not None else (0, 0)
        )
        # No wider than the rows (experts split across tensor-parallel ranks have few columns)
        self.block_k = min(block_k, max(16, triton.next_power_of_2(k)))
        if self.mode == 2:
            if self.group & (self.group - 1) or self.group < 16:
                raise ValueError(f"FP8 experts' groups of {self.group} columns: not a power of two")
            self.block_k = self.group if exact else min(block_k, self.group)
