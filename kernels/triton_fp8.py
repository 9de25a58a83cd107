"""FP8 W8A8 linear layers in Triton: the activation quantization in one kernel (per token, or
by a static scale), and decode-sized products (up to 64 rows) through the skinny linear
kernel with FP8 operands.

Same math as `kernels.fp8`: a row's scale is its absolute maximum over e4m3's largest value
(448), the quantized row is x / scale rounded to e4m3, and the product sums the FP8 operands'
float products, then multiplies by x_scale[row] * w_scale[col]. At decode, reading the weight
is the whole cost, and FP8 halves it; most layers take rows their producer quantized
(`Fp8Rows`), the others pay one small launch.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8, Fp8Rows, check_group_layer, check_static_scale
from kernels.triton_e4m3 import scale_for, to_e4m3
from kernels.triton_linear import MAX_ROWS, LinearTiles, launch_skinny_linear
from kernels.triton_pdl import launches_early, wait_for_previous_kernel

_QUANT_BLOCK = 2048  # elements of a row per loop step


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
    tiles: LinearTiles | None = None,  # None: fp8_default_tiles
) -> torch.Tensor:  # [M, N], x's float dtype
    """`kernels.fp8.fp8_linear_reference` for decode-sized M: x quantized per token (unless
    its producer did), then the FP8 weight streamed once by the skinny linear kernel."""
    (m, x_k), (n, k) = (x.q if isinstance(x, Fp8Rows) else x).shape, qweight.shape
    if not 1 <= m <= MAX_ROWS or x_k != k or qweight.dtype != FP8:
        raise ValueError(f"x [{m}, {x_k}], qweight {tuple(qweight.shape)} {qweight.dtype}")
    rows = x if isinstance(x, Fp8Rows) else Fp8Rows(*quantize_fp8_rowwise(x), x.dtype)
    tiles = tiles or fp8_default_tiles(m, n, k)
    out = torch.empty((m, n), dtype=rows.dtype, device=rows.q.device)
    launch_skinny_linear(rows.q, qweight, bias, out, tiles, (rows.scale, weight_scale))
    return out


def fp8_default_tiles(m: int, n: int, k: int) -> LinearTiles:
    """benchmarks/fp8_sweep.py's picks (H100, Llama-3.1-8B shapes, 2026-11-26), in tl.dot
    tiles of 32 output columns: 512 K per step (512 weight bytes per row) where N is 4096 or
    less (o, down at M = 1: 11.7 and 30.7 us against 12.0 and 32.2 with the bf16 tiles'
    doubled K), 256 K and 5 stages on wider layers (qkv 14.9 against 16.8, gate_up 46.6
    against 51.5). Past 16 rows the wider layers take 64 columns and 512 K (M = 32 / 64: qkv
    15.8 / 15.8, gate_up 50.0 / 52.0 us). K never exceeds K rounded up to a power of two
    (small test shapes)."""
    block_n, block_k, stages = (32, 512, 4) if n <= 4096 else (32, 256, 5)
    if m > 16 and n > 4096:
        block_n, block_k, stages = 64, 512, 3
    block_k = max(32, min(block_k, triton.next_power_of_2(k)))
    return LinearTiles(block_n=block_n, block_k=block_k, num_warps=4, num_stages=stages)


# -- Block-scaled FP8: activations per token and group, one tl.dot per group --------------


GROUP_MIN = 32  # an FP8 tl.dot needs K >= 32


@dataclasses.dataclass(frozen=True)
class Fp8GroupTiles:
    block_m: int  # >= 16 (tl.dot)
    block_n: int
    num_warps: int
    num_stages: int


def fp8_group_default_tiles(m: int) -> Fp8GroupTiles:
    """benchmarks/fp8_block_sweep.py's picks (H100, Llama-3.1-8B shapes, 128 x 128 blocks,
    2026-11-26): within 5 % of per-channel FP8's skinny kernel at 1-16 rows on qkv, o and
    gate_up. Past 16 rows `ops.fp8_group_linear` uses cuBLASLt where it can (faster from 256
    rows on); these tiles serve the layers it cannot take."""
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
