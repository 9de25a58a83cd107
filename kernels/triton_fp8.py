"""FP8 W8A8 linear layers in Triton: the activation quantization in one kernel (per token, or
by a static scale), and decode-sized products (up to 64 rows) through an FP8 GEMV.

Same math as `kernels.fp8`: a row's scale is its absolute maximum over e4m3's largest value
(448), the quantized row is x / scale rounded to e4m3, and the product sums the FP8 operands'
float products, then multiplies by x_scale[row] * w_scale[col]. At decode, reading the weight
is the whole cost, and FP8 halves it; most layers take rows their producer quantized
(`Fp8Rows`), the others pay one small launch.

The GEMV computes out^T = W x^T: the weight tile is the MMA's first operand (64 weight rows a
warpgroup on Hopper) and x^T the second, whose least width is 8, so a row of x pads to 8, and
the FP8 tiles go from shared memory into wgmma as they are. With x as the first operand (the
bf16 skinny kernel's way) x pads to 16 rows and Triton's 16-row MMA on Hopper takes FP8 only
converted to fp16 in registers: the conversions were half of that loop's instructions.
Narrow layers split K (kernels/triton_split_k.py) to fill the GPU.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels import triton_split_k as split_k
from kernels.fp8 import FP8, Fp8Rows, check_group_layer, check_static_scale
from kernels.triton_e4m3 import scale_for, to_e4m3
from kernels.triton_linear import MAX_ROWS, NARROW_N, WIDE_K, WIDE_N
from kernels.triton_pdl import (
    L2_LINE_BYTES,
    launches_early,
    prefetch_to_l2,
    wait_for_previous_kernel,
)
from kernels.triton_split_k import sum_of_splits
from kernels.triton_stages import launch_fitting

_QUANT_BLOCK = 2048  # elements of a row per loop step
L2_LINE = tl.constexpr(L2_LINE_BYTES)  # FP8: a byte an element


@triton.jit
def _quantize_rowwise_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] float8e4nv
    scale_ptr,  # [M] float32
    static_scale_ptr,  # [1] float32 with STATIC
    k,
    stride_x_row,
    stride_q_row,
    BLOCK: tl.constexpr,
    STATIC: tl.constexpr,  # every row scaled by the calibrated scale: no pass over it first
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_scale_ptr)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for start in range(0, k, BLOCK):  # pass 1: the row's absolute maximum
            mask = start + cols < k
            x = tl.load(x_ptr + row * stride_x_row + start + cols, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = scale_for(tl.max(amax, axis=0))
    tl.store(scale_ptr + row, scale)
    for start in range(0, k, BLOCK):  # pass 2: the row in e4m3 (read again: from L2)
        mask = start + cols < k
        x = tl.load(x_ptr + row * stride_x_row + start + cols, mask=mask, other=0.0)
        q = to_e4m3(x.to(tl.float32) / scale)
        tl.store(q_ptr + row * stride_q_row + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_fp8_rowwise(
    x: torch.Tensor,  # [R, C], last dimension contiguous
    static_scale: torch.Tensor | None = None,  # [1] float32: a checkpoint's calibrated scale
) -> tuple[torch.Tensor, torch.Tensor]:  # ([R, C] float8_e4m3fn, [R, 1] float32)
    """`kernels.fp8.quantize_fp8_rowwise_reference`: one program per row."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D and contiguous in its last dimension, got {x.shape}")
    check_static_scale(static_scale)
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    early = launches_early(x)
    _quantize_rowwise_kernel[(rows,)](
        x,
        q,
        scale,
        static_scale if static_scale is not None else scale,  # read only with STATIC
        cols,
        x.stride(0),
        q.stride(0),
        BLOCK=min(_QUANT_BLOCK, triton.next_power_of_2(cols)),
        STATIC=static_scale is not None,
        PDL=early,
        num_warps=4,
        launch_pdl=early,
    )
    return q, scale


def fp8_skinny_linear(
    x: torch.Tensor | Fp8Rows,  # [M, K], 1 <= M <= MAX_ROWS, bf16/fp16/fp32 or quantized
    qweight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N], x's float dtype
    *,
    tiles: Fp8Tiles | None = None,  # None: fp8_default_tiles
) -> torch.Tensor:  # [M, N], x's float dtype
    """`kernels.fp8.fp8_linear_reference` for decode-sized M: x quantized per token (unless
    its producer did), then the FP8 weight streamed once by the FP8 GEMV."""
    (m, x_k), (n, k) = (x.q if isinstance(x, Fp8Rows) else x).shape, qweight.shape
    if not 1 <= m <= MAX_ROWS or x_k != k or qweight.dtype != FP8:
        raise ValueError(f"x [{m}, {x_k}], qweight {tuple(qweight.shape)} {qweight.dtype}")
    rows = x if isinstance(x, Fp8Rows) else Fp8Rows(*quantize_fp8_rowwise(x), x.dtype)
    tiles = tiles or fp8_default_tiles(m, n, k)
    out = torch.empty((m, n), dtype=rows.dtype, device=rows.q.device)
    _launch_gemv(rows, qweight, weight_scale, bias, out, tiles)
    return out


# -- The FP8 GEMV: the weight the MMA's first operand, FP8 products on the tensor cores ------


@dataclasses.dataclass(frozen=True)
class Fp8Tiles:
    """One launch of the FP8 GEMV (_fp8_gemv_kernel)."""

    block_m: int  # rows of x per program (the MMA's N): 8 to 64
    block_n: int  # weight rows per program (the MMA's M): 64 per 4 warps for Hopper's wgmma
    block_k: int  # K per step, >= 32
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs along K per output tile (kernels/triton_split_k.py)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"Fp8Tiles.{name} must be a power of two, got {value}")
        if self.block_m < 8 or self.block_n < 16 or self.block_k < 32 or self.num_stages < 1:
            raise ValueError(f"{self}: block_m >= 8, block_n >= 16, block_k >= 32, stages >= 1")
        if self.split_k < 1:
            raise ValueError(f"Fp8Tiles.split_k must be >= 1, got {self.split_k}")


def fp8_default_tiles(m: int, n: int, k: int) -> Fp8Tiles:
    """sweeps/fp8_sweep.py's picks (H100, Llama-3.1-8B shapes, rows quantized by their
    producer, 2026-11-28; docs/benchmarks-history.md has the table): 64 weight rows over 4 warps, x
    in tiles of 8 rows up to 8 rows, then M rounded up to a power of two; K steps of 512 in 4
    stages (3 past 32 rows), but of 256 for gate_up-like N past 8 rows, and of 256 in 4 stages
    for o-like layers past 32; narrow N (o, down: 64 output tiles) split K in 4 up to 8 rows,
    then in 2, into at most half as many splits as K steps. Within 0.6 us of the best per
    shape at 1-64 rows; a layer's four projections at 1 / 8 / 32 / 64 rows take 85.4 / 86.8 /
    91.4 / 97.7 us, against 87.9 / 89.4 / 98.6 / 107.5 with the skinny kernel's FP8 tiles
    before."""
    narrow, wide = n <= NARROW_N, n >= WIDE_N
    block_k = 256 if wide and m > 8 else 512
    stages = 3 if m > 32 else 4
    if narrow and k < WIDE_K and m > 32:  # o
        block_k, stages = 256, 4
    block_k = max(32, min(block_k, triton.next_power_of_2(k)))
    split = (4 if m <= 8 else 2) if narrow else 1
    return Fp8Tiles(
        block_m=max(8, triton.next_power_of_2(m)),
        block_n=64,
        block_k=block_k,
        num_warps=4,
        num_stages=stages,
        split_k=max(1, min(split, triton.cdiv(k, block_k) // 2)),
    )


# NOTE: m is not specialised (M = 1 shares the compile of its row tile).
@triton.jit(do_not_specialize=["m"])
def _fp8_gemv_kernel(
    x_ptr,  # [M, K] float8e4nv
    x_scale_ptr,  # [M] float32
    w_ptr,  # [N, K] float8e4nv
    w_scale_ptr,  # [N] float32
    bias_ptr,  # [N] with HAS_BIAS
    out_ptr,  # [M, N]
    partials_ptr,  # [SPLIT_K, M, N] float32 with SPLIT_K > 1
    tickets_ptr,  # [output tiles] int32, zero between launches, with SPLIT_K > 1
    m,
    n,
    k,
    stride_x_row,
    stride_w_row,
    stride_out_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    IMPRECISE_ACC: tl.constexpr,  # K summed in the MMA's reduced precision at most
    INTERPRETED: tl.constexpr,  # TRITON_INTERPRET: float32 dots (see triton_linear's UPCAST)
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
    PREFETCH_LINES: tl.constexpr,  # with PDL: the 128-byte lines of its first step a row
):
    """out[rows, cols]^T = (W[cols] x[rows]^T) w_scale[cols] x_scale[rows]. The weight tile is
    the MMA's first operand and x^T its second, so one row of x pads to 8 (the MMA's least N),
    not 16, and on Hopper the FP8 tiles go from shared memory to wgmma as they are: no
    conversion and no register staging, which bounded the skinny kernel's FP8 steps."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] weight rows
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows of x
    ks = tl.arange(0, BLOCK_K)
    col_valid = cols < n
    row_valid = rows < m
    steps = tl.cdiv(tl.cdiv(k, BLOCK_K), SPLIT_K)
    k_begin = tl.program_id(2) * steps * BLOCK_K
    k_end = tl.minimum(k_begin + steps * BLOCK_K, k)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_w_row + (k_begin + ks)[None, :]
    x_ptrs = x_ptr + rows[None, :] * stride_x_row + (k_begin + ks)[:, None]  # [BK, BM]
    if PREFETCH_LINES > 0:  # into L2 while the previous kernel ends (safe: kernels.triton_pdl)
        lines = tl.minimum(k_begin + tl.arange(0, PREFETCH_LINES) * L2_LINE, k - 1)
        first = tl.minimum(cols, n - 1).to(tl.int64)[:, None] * stride_w_row + lines[None, :]
        prefetch_to_l2(w_ptr + first)
    wait_for_previous_kernel(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        # Steps are whole with EVEN_K (a split's end is a multiple of BLOCK_K or K itself).
        k_valid = tl.full([BLOCK_K], True, tl.int1) if EVEN_K else k_start + ks < k
        w = tl.load(w_ptrs, mask=col_valid[:, None] & k_valid[None, :], other=0.0)
        xt = tl.load(x_ptrs, mask=k_valid[:, None] & row_valid[None, :], other=0.0)
        if INTERPRETED:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:  # wgmma sums FP8 products in reduced precision: promoted every IMPRECISE_ACC
            acc = tl.dot(w, xt, acc, max_num_imprecise_acc=IMPRECISE_ACC)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    mask = col_valid[:, None] & row_valid[None, :]  # [BN, BM]
    if SPLIT_K > 1:
        acc, last = sum_of_splits(acc, partials_ptr, tickets_ptr, rows, cols, mask, m, n, SPLIT_K)
        if not last:
            return
    w_scale = tl.load(w_scale_ptr + cols, mask=col_valid, other=0.0)
    x_scale = tl.load(x_scale_ptr + rows, mask=row_valid, other=0.0)
    acc = acc * w_scale[:, None] * x_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows[None, :] * stride_out_row + cols[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_gemv(
    rows: Fp8Rows,
    qweight: torch.Tensor,  # [N, K]
    weight_scale: torch.Tensor,  # [N]
    bias: torch.Tensor | None,
    out: torch.Tensor,  # [M, N], written
    tiles: Fp8Tiles,
) -> None:
    (m, k), n = rows.q.shape, qweight.shape[0]
    if rows.q.stride(1) != 1 or qweight.stride(1) != 1:
        raise ValueError("x and qweight must be contiguous along K")
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(m, tiles.block_m), tiles.split_k)
    partials, tickets = split_k.workspace(grid, m, n, out, tiles)
    early = launches_early(rows.q)
    args = (
        rows.q,
        rows.scale,
        qweight,
        weight_scale,
        bias if bias is not None else weight_scale,
        out,
        partials,
        tickets,
        m,
        n,
        k,
        rows.q.stride(0),
        qweight.stride(0),
        out.stride(0),
    )
    constants = dict(
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        SPLIT_K=tiles.split_k,
        HAS_BIAS=bias is not None,
        EVEN_K=k % tiles.block_k == 0,
        IMPRECISE_ACC=min(128, tiles.block_k),
        INTERPRETED=not rows.q.is_cuda,
        PDL=early,
        PREFETCH_LINES=triton.cdiv(tiles.block_k, L2_LINE_BYTES) if early else 0,
        num_warps=tiles.num_warps,
        launch_pdl=early,
    )
    variant = ("fp8_gemv", out.device, out.dtype, *constants.values())
    launch_fitting(
        variant,
        tiles.num_stages,
        lambda stages: _fp8_gemv_kernel[grid](*args, **constants, num_stages=stages),
    )


# -- Block-scaled FP8: activations per token and group, one tl.dot per group --------------


GROUP_MIN = 32  # an FP8 tl.dot needs K >= 32


@dataclasses.dataclass(frozen=True)
class Fp8GroupTiles:
    block_m: int  # >= 16 (tl.dot)
    block_n: int
    num_warps: int
    num_stages: int


def fp8_group_default_tiles(m: int) -> Fp8GroupTiles:
    """sweeps/fp8_block_sweep.py's picks (H100, Llama-3.1-8B shapes, 128 x 128 blocks,
    2026-11-26): within 5 % of per-channel FP8's skinny-kernel path of that day (since
    replaced by the faster FP8 GEMV) at 1-16 rows on qkv, o and gate_up. Past 16 rows
    `quantized_ops.fp8_group_linear` uses cuBLASLt where it can (faster from 256 rows on);
    these tiles serve the layers it cannot take."""
    if m <= 16:
        return Fp8GroupTiles(16, 32, num_warps=4, num_stages=4)
    return Fp8GroupTiles(64, 64, 4, 4) if m <= 512 else Fp8GroupTiles(64, 128, 4, 3)


@triton.jit
def _quantize_groupwise_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] float8e4nv
    scale_ptr,  # [M, K / GROUP] float32
    stride_x_row,
    stride_q_row,
    stride_scale_row,
    GROUP: tl.constexpr,
):
    row, group = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_x_row + cols).to(tl.float32)
    scale = scale_for(tl.max(tl.abs(x), axis=0))
    tl.store(scale_ptr + row * stride_scale_row + group, scale)
    q = to_e4m3(x / scale)
    tl.store(q_ptr + row * stride_q_row + cols, q.to(q_ptr.dtype.element_ty))


def quantize_fp8_groupwise(
    x: torch.Tensor,  # [R, C], C a multiple of group, last dimension contiguous
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([R, C] float8_e4m3fn, [R, C / group] float32)
    """`kernels.fp8.quantize_fp8_groupwise_reference`: one program per row and group."""
    rows, cols = x.shape
    if cols % group or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)}: contiguous rows of whole groups of {group}")
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scale = torch.empty((rows, cols // group), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_groupwise_kernel[(rows, cols // group)](
            x, q, scale, x.stride(0), q.stride(0), scale.stride(0),
            GROUP=group, num_warps=1,
        )  # fmt: skip
    return q, scale


@triton.jit(do_not_specialize=["m"])
def _fp8_group_linear_kernel(
    qx_ptr,  # [M, K] float8e4nv
    x_scale_ptr,  # [M, G] float32
    qweight_ptr,  # [N, K] float8e4nv
    w_scale_ptr,  # [N, G] float32
    bias_ptr,  # [N] with HAS_BIAS
    out_ptr,  # [M, N]
    m,
    n,
    num_groups,
    stride_qx_row,
    stride_x_scale_row,
    stride_qweight_row,
    stride_w_scale_row,
    stride_out_row,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < m, offs_n < n
    cols = tl.arange(0, GROUP)
    x_rows = qx_ptr + offs_m[:, None].to(tl.int64) * stride_qx_row + cols[None, :]
    w_rows = qweight_ptr + offs_n[:, None].to(tl.int64) * stride_qweight_row + cols[None, :]
    x_scales = x_scale_ptr + offs_m.to(tl.int64) * stride_x_scale_row
    w_scales = w_scale_ptr + offs_n.to(tl.int64) * stride_w_scale_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, num_groups):
        qx = tl.load(x_rows + g * GROUP, mask=m_mask[:, None], other=0.0)  # [BM, GROUP]
        qw = tl.load(w_rows + g * GROUP, mask=n_mask[:, None], other=0.0)  # [BN, GROUP]
        products = tl.dot(qx, tl.trans(qw), out_dtype=tl.float32)  # the group's FP8 sums
        x_scale = tl.load(x_scales + g, mask=m_mask, other=0.0)
        w_scale = tl.load(w_scales + g, mask=n_mask, other=0.0)
        acc += products * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_out_row + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_group_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N, K / group] float32
    group: int,
    bias: torch.Tensor | None = None,  # [N]
    *,
    tiles: Fp8GroupTiles | None = None,  # None: fp8_group_default_tiles(M)
) -> torch.Tensor:  # [M, N], x.dtype
    """`kernels.fp8.fp8_group_linear_reference`: x quantized per token and group, then one
    FP8 tl.dot per group of each [BLOCK_M, BLOCK_N] tile, scaled by both operands' scales."""
    (m, k), n = x.shape, qweight.shape[0]
    check_group_layer(qweight, weight_scale, group)
    if qweight.shape[1] != k or group < GROUP_MIN:
        raise ValueError(
            f"x {tuple(x.shape)} against qweight {tuple(qweight.shape)}, group {group}"
        )
    qx, x_scale = quantize_fp8_groupwise(x, group)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tiles = tiles or fp8_group_default_tiles(m)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _fp8_group_linear_kernel[grid](
        qx, x_scale, qweight, weight_scale, bias if bias is not None else x_scale, out,
        m, n, k // group,
        qx.stride(0), x_scale.stride(0), qweight.stride(0), weight_scale.stride(0), out.stride(0),
        GROUP=group, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, HAS_BIAS=bias is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out
