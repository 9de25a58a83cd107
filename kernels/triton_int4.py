"""int4 weight-only linear layers in Triton: the packed weight dequantized in registers.

Same layout as `kernels.int4` (read its docstring). Up to 64 rows one kernel: a program owns a
[BLOCK_M, BLOCK_N] tile of the output and walks K, loading BLOCK_K/8 packed words per weight
row and unpacking them nibble by nibble with shifts (the kernel's docstring says why). At
decode the grid is the skinny linear's: programs over N, each streaming its weight rows once;
the bytes read are a quarter of bf16's plus the scales. Past 64 rows the weight is dequantized
to the activation's dtype by a second kernel, then multiplied by cuBLAS.

Scales and zero points: without act-order, one per packed word (a word's 8 columns share a
group), loaded once per K step; the multiply-add variant and the one-group tl.dot steps apply
them after the step's sum, in float32, so they are closer to the exact product than the
reference, which rounds each dequantized weight to the activation's dtype first (the tests
allow for that). With act-order, one per column, gathered by g_idx, the weight made whole and
rounded as the reference does.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.int4 import PACK

DOT_MIN = 16  # tl.dot needs every dimension >= 16
DEQUANTIZE_ABOVE_ROWS = 64
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Int4Tiles:
    block_m: int  # rows per program; with use_dot at least 16
    block_n: int
    block_k: int  # columns per K step: 8 x a power of two words; >= 128 for tl.dot
    num_warps: int
    num_stages: int
    use_dot: bool  # False: multiply-add over [BM, BN, BK] and one reduction (M = 1)


def default_tiles(m: int, n: int, k: int) -> Int4Tiles:
    """benchmarks/int4_sweep.py's picks (H100, Llama-3.1-8B shapes, groups of 128, 2026-11-26;
    docs/benchmarks.md has the table). Up to 4 rows the multiply-add variant, streaming 1024
    columns per step at M = 1 and 512 at M = 2-4 (never more than K rounded up to a power of
    two); from 5 rows, and for the widest layer (gate_up) at any M, tl.dot tiles of 16 rows
    (side by side past 16: tiles of 64 measured 2-4x slower) with steps of 128 columns, which
    lie inside a group of 128 and so take 128 + q as the operand."""
    wide = n >= 16384
    if m <= 4 and not wide:
        rows = triton.next_power_of_2(m)
        block_k = min(1024 if m == 1 else 512, triton.next_power_of_2(k))
        stages = 3 if m == 1 else 4
        return Int4Tiles(rows, 8, block_k, num_warps=4, num_stages=stages, use_dot=False)
    if wide:
        return Int4Tiles(16, 128, 128, num_warps=8, num_stages=3, use_dot=True)
    return Int4Tiles(16, 64, 128, num_warps=4, num_stages=4, use_dot=True)


@triton.jit(do_not_specialize=["m", "group_size"])
def _int4_linear_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [N, K/8] int32
    scales_ptr,  # [N, G]
    zeros_ptr,  # [N, G] uint8 with HAS_ZEROS; any pointer otherwise
    g_idx_ptr,  # [K] int32 with HAS_G_IDX
    bias_ptr,  # [N] with HAS_BIAS
    out_ptr,  # [M, N]
    m,
    n,
    k,
    group_size,
    stride_x_row,
    stride_qweight_row,
    stride_scales_row,
    stride_zeros_row,
    stride_out_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,  # packed words per weight row per K step: the step is 8 * WORDS columns
    USE_DOT: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MAGIC: tl.constexpr,  # 0, or the bits of 128.0 (bf16) / 1024.0 (fp16), for tl.dot steps
    #                       that lie inside one group: see below
    EVEN_K: tl.constexpr,  # K % (8 * WORDS) == 0
    DOT_PRECISION: tl.constexpr,  # read for float32 operands only
    INTERPRETED: tl.constexpr,  # TRITON_INTERPRET: tl.dot on float32 tiles (see triton_linear)
):
    """Why nibble by nibble: nibble i of the step's words [BN, W] holds the columns
    k_start + 8 w + i, so it multiplies the x columns of that stride, and the 8 products add up
    to the step's; no tile is reshaped. A word's 8 columns share a group (group sizes are
    multiples of 8), so without act-order the scales and zero points are loaded once per step,
    one per word. Why 2**23: OR-ing a nibble q into the bits of float32's 2**23 gives the
    number 2**23 + q, and one subtraction gives q - z, with no integer-to-float conversion (a
    slow instruction). MAGIC does the same in bf16 (128.0) for tl.dot, whose operand is then
    128 + q as is: the offset and the zero point come off the step's sum once, as
    sum x (128 + q) - (128 + z) sum x."""
    # Row tiles vary fastest: the programs that share a weight block run side by side, so it
    # comes from HBM once and from L2 for the others.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    words = tl.arange(0, WORDS)  # [W]
    row_valid = rows < m
    col_valid = cols < n
    x_rows = x_ptr + rows[:, None] * stride_x_row  # [BM, 1]
    w_ptrs = qweight_ptr + cols[:, None].to(tl.int64) * stride_qweight_row + words[None, :]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, WORDS], tl.float32)

    for k_start in range(0, k, 8 * WORDS):
        # K % 8 == 0, so a word is whole or out.
        word_valid = tl.full([WORDS], True, tl.int1) if EVEN_K else k_start + 8 * words < k
        mask = col_valid[:, None] & word_valid[None, :]  # [BN, W]
        packed = tl.load(w_ptrs, mask=mask, other=0)
        if MAGIC != 0:  # the step lies inside one group: a scale and zero point per column
            group = k_start // group_size
            scale_ptrs = scales_ptr + cols * stride_scales_row + group
            step_scale = tl.load(scale_ptrs, mask=col_valid, other=0.0).to(tl.float32)  # [BN]
            step_zero = tl.full([BLOCK_N], 8.0, tl.float32)
            if HAS_ZEROS:
                zero_ptrs = zeros_ptr + cols * stride_zeros_row + group
                step_zero = tl.load(zero_ptrs, mask=col_valid, other=0).to(tl.float32)
            step_offset = step_zero + (128.0 if MAGIC == 0x4300 else 1024.0)
        elif not HAS_G_IDX:  # a scale and a zero point per word, for the whole step
            groups = (k_start + 8 * words) // group_size  # [W]
            offsets = cols[:, None] * stride_scales_row + groups[None, :]
            scale = tl.load(scales_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            zero = tl.full([BLOCK_N, WORDS], 8.0, tl.float32)
            if HAS_ZEROS:
                offsets = cols[:, None] * stride_zeros_row + groups[None, :]
                zero = tl.load(zeros_ptr + offsets, mask=mask, other=0).to(tl.float32)
            float_zero = zero + 8388608.0  # 2**23 + z
        if USE_DOT:
            step = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # read with MAGIC
        else:
            step = tl.zeros([BLOCK_M, BLOCK_N, WORDS], tl.float32)
        x_sum = tl.zeros([BLOCK_M, WORDS], tl.float32)  # read with MAGIC
        for i in tl.static_range(8):
            ks = k_start + 8 * words + i  # [W] the columns of nibble i
            x_mask = row_valid[:, None] & word_valid[None, :]
            x = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)  # [BM, W]
            q = (packed >> (4 * i)) & 0xF  # [BN, W] int32
            if MAGIC != 0:  # tl.dot on 128 + q; the step lies inside one group
                w = (q | MAGIC).to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True)
                step = tl.dot(x, tl.trans(w), step)
                x_sum += x.to(tl.float32)
            elif not HAS_G_IDX and not USE_DOT:
                qz = (q | 0x4B000000).to(tl.float32, bitcast=True) - float_zero  # q - z
                step += x.to(tl.float32)[:, None, :] * qz[None, :, :]  # [BM, BN, W]
            else:
                if HAS_G_IDX:  # the scale and zero point of each column, gathered
                    col_groups = tl.load(g_idx_ptr + ks, mask=word_valid, other=0)  # [W]
                    offsets = cols[:, None] * stride_scales_row + col_groups[None, :]
                    scale = tl.load(scales_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                    float_zero = tl.full([BLOCK_N, WORDS], 8.0 + 8388608.0, tl.float32)
                    if HAS_ZEROS:
                        offsets = cols[:, None] * stride_zeros_row + col_groups[None, :]
                        zero = tl.load(zeros_ptr + offsets, mask=mask, other=0)
                        float_zero = zero.to(tl.float32) + 8388608.0
                qz = (q | 0x4B000000).to(tl.float32, bitcast=True) - float_zero
                # Rounded to x's dtype, as the reference dequantizes.
                w = (qz * scale).to(x_ptr.dtype.element_ty)  # [BN, W]
                if USE_DOT and INTERPRETED:
                    acc = tl.dot(
                        x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee"
                    )
                elif USE_DOT:
                    acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
                else:
                    acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        if MAGIC != 0:
            x_total = tl.sum(x_sum, axis=1)  # [BM]
            acc += (step - x_total[:, None] * step_offset[None, :]) * step_scale[None, :]
        elif not HAS_G_IDX and not USE_DOT:
            acc += step * scale[None, :, :]
        w_ptrs += WORDS

    if not USE_DOT:
        acc = tl.sum(acc, axis=2)  # [BM, BN]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_out_row + cols[None, :]
    out_mask = row_valid[:, None] & col_valid[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _dequantize_kernel(
    qweight_ptr,  # [N, K/8] int32
    scales_ptr,  # [N, G]
    zeros_ptr,  # [N, G] uint8 with HAS_ZEROS
    g_idx_ptr,  # [K] int32 with HAS_G_IDX
    out_ptr,  # [N, K]
    n,
    k,
    group_size,
    stride_qweight_row,
    stride_scales_row,
    stride_zeros_row,
    stride_out_row,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
):
    """out = the dequantized weight, rounded to out's dtype (the reference's rounding). The
    tile is unpacked as [BN, W, 8] and stored as [BN, 8 W]: whole rows of out, contiguous."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] weight rows
    words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)  # [W]
    ks = tl.program_id(1) * WORDS * 8 + tl.arange(0, WORDS * 8)  # [8 W] columns
    row_valid = cols < n
    offsets = cols[:, None].to(tl.int64) * stride_qweight_row + words[None, :]
    packed = tl.load(qweight_ptr + offsets, mask=row_valid[:, None] & (words < k // 8)[None, :])
    q = (packed[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF  # [BN, W, 8]
    q = tl.reshape(q, [BLOCK_N, WORDS * 8])  # column 8 w + i at 8 w + i
    mask = row_valid[:, None] & (ks < k)[None, :]  # [BN, 8W]
    if HAS_G_IDX:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
        groups = tl.load(g_idx_ptr + ks, mask=ks < k, other=0)
    else:
        groups = ks // group_size
    scale = tl.load(scales_ptr + cols[:, None] * stride_scales_row + groups[None, :], mask=mask)
    zero = 8.0
    if HAS_ZEROS:
        zero_ptrs = zeros_ptr + cols[:, None] * stride_zeros_row + groups[None, :]
        zero = tl.load(zero_ptrs, mask=mask, other=0).to(tl.float32)
    qf = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    w = (qf - zero) * scale.to(tl.float32)
    out_ptrs = out_ptr + cols[:, None].to(tl.int64) * stride_out_row + ks[None, :]
    tl.store(out_ptrs, w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_int4(
    qweight: torch.Tensor,  # [N, K/8] int32
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None,  # [N, G] uint8
    group_size: int,
    g_idx: torch.Tensor | None,  # [K] int32
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K]
    """`kernels.int4.dequantize_int4_reference`, rounded to `dtype`, in one launch."""
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n, words = 16, 32
    grid = (triton.cdiv(n, block_n), triton.cdiv(k // PACK, words))
    _dequantize_kernel[grid](
        qweight,
        scales,
        zeros if zeros is not None else scales,
        g_idx if g_idx is not None else qweight,
        out,
        n,
        k,
        group_size,
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        out.stride(0),
        BLOCK_N=block_n,
        WORDS=words,
        HAS_ZEROS=zeros is not None,
        HAS_G_IDX=g_idx is not None,
        num_warps=4,
    )
    return out


def _check_inputs(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    g_idx: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> None:
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in DTYPES:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} must be [M, {k}] of {DTYPES}")
    if qweight.dtype != torch.int32 or qweight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("qweight must be int32, and x and qweight contiguous along K")
    num_groups = scales.shape[1]
    if scales.shape[0] != n or scales.stride(1) != 1:
        raise ValueError(f"scales {tuple(scales.shape)} must be [{n}, G], contiguous along G")
    if zeros is not None and (zeros.shape != scales.shape or zeros.dtype != torch.uint8):
        raise ValueError(f"zeros must be uint8 {tuple(scales.shape)}, got {tuple(zeros.shape)}")
    if zeros is not None and zeros.stride(1) != 1:
        raise ValueError("zeros must be contiguous along G")
    if g_idx is None and num_groups * group_size < k:
        raise ValueError(f"{num_groups} groups of {group_size} do not cover K={k}")
    if g_idx is not None and (g_idx.shape != (k,) or g_idx.dtype != torch.int32):
        raise ValueError(f"g_idx must be int32 [{k}], got {g_idx.dtype} {tuple(g_idx.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")


def int4_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K/8] int32
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None,  # [N, G] uint8; None: 8
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
    bias: torch.Tensor | None = None,  # [N]
    *,
    tiles: Int4Tiles | None = None,  # None: default_tiles(M, N, K)
) -> torch.Tensor:  # [M, N], x.dtype
    """`kernels.int4.int4_linear_reference`: up to DEQUANTIZE_ABOVE_ROWS rows one launch that
    reads the packed weight; past that the weight dequantized to x's dtype, then cuBLAS (a
    prefill's GEMM is compute-bound, and the dequantization is a small pass beside it)."""
    _check_inputs(x, qweight, scales, zeros, group_size, g_idx, bias)
    m, n, k = x.shape[0], qweight.shape[0], x.shape[1]
    if m > DEQUANTIZE_ABOVE_ROWS and tiles is None:
        weight = dequantize_int4(qweight, scales, zeros, group_size, g_idx, x.dtype)
        return torch.nn.functional.linear(x, weight, bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    tiles = tiles or default_tiles(m, n, k)
    if tiles.use_dot and tiles.block_k < 8 * DOT_MIN:
        raise ValueError(f"{tiles}: tl.dot needs block_k >= {8 * DOT_MIN} (16 words)")
    if tiles.use_dot and min(tiles.block_m, tiles.block_n) < DOT_MIN:
        raise ValueError(f"{tiles}: tl.dot needs block_m and block_n >= {DOT_MIN}")
    words = tiles.block_k // PACK
    magic = {torch.bfloat16: 0x4300, torch.float16: 0x6400}.get(x.dtype, 0)
    magic = magic if tiles.use_dot and x.is_cuda else 0  # bf16 tl.dot: see triton_linear
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _int4_linear_kernel[grid](
        x,
        qweight,
        scales,
        zeros if zeros is not None else scales,
        g_idx if g_idx is not None else qweight,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        group_size,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        out.stride(0),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        WORDS=words,
        USE_DOT=tiles.use_dot,
        HAS_ZEROS=zeros is not None,
        HAS_G_IDX=g_idx is not None,
        HAS_BIAS=bias is not None,
        MAGIC=magic if g_idx is None and group_size % tiles.block_k == 0 else 0,
        EVEN_K=k % tiles.block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        INTERPRETED=not x.is_cuda,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
