"""int4 kernels that make the weight whole (kernels/triton_int4.py dispatches to them).

- **dequant_dot** (what the rows and dot kernels do not take: act-order, groups of 32 or 64,
  float32 x): x is tl.dot's first operand; nibble by nibble, the weight is made whole from its
  scales and zero points (per column with act-order, gathered by g_idx) and rounded to x's
  dtype as the reference does.
- **the dequantize pass** past kernels.triton_int4.DEQUANTIZE_ABOVE_ROWS rows: the weight
  written out in the activation's dtype, for cuBLAS (`dequantized_linear`). Up to
  SLICED_MAX_ROWS rows (the steps CUDA graphs hold) it can go a slice of rows at a time, into
  one scratch buffer of DEQUANTIZE_SLICE_BYTES, each slice's product going into its columns of the
  output: a slice the pass wrote can still be in L2 when cuBLAS reads it, where the whole
  weight (Qwen3-8B's gate_up: 201 MB in bf16) goes out to memory and back. Past that a step is
  compute-bound, and mostly eager (a launch pair a slice would cost the host).

`operands` builds the leading arguments every int4 kernel takes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.int4 import CHUNK, PACK, Int4Tiles

DOT_MIN = 16  # the dequant_dot kernel's tiles: tl.dot with every dimension >= 16
# The dequantize pass's columns a program (one weight row): 0.8-3.6 TB/s of weights read and
# written at Qwen3-8B's shapes on an H200, o and qkv the least (of 1024-8192, 2026-12-04).
DEQUANTIZE_BLOCK_K = 4096
# 0 (the whole weight at once) until a GPU says which slice, if any, is faster: the sweep
# (sweeps/int4_sweep.py, SLICE_MB) and whole steps (scripts/device_ab.sh).
DEQUANTIZE_SLICE_BYTES = 0
SLICE_ROWS_MULTIPLE = 64
SLICED_MAX_ROWS = 512
_CHUNK = tl.constexpr(CHUNK)


def operands(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> tuple[object, ...]:
    """The leading arguments every int4 kernel takes: pointers, N, K and row strides (a tensor
    the kernel does not read stands in for a missing one)."""
    return (
        x,
        qweight,
        scales,
        zeros if zeros is not None else scales,
        bias if bias is not None else scales,
        out,
        qweight.shape[0],
        x.shape[1],
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        out.stride(0),
    )


@triton.jit
def _nibble_columns(k_start, words, i: tl.constexpr):
    """The columns [W] that nibble i of the step's words hold (the chunk interleave)."""
    return k_start + (words // 4) * _CHUNK + 8 * (i // 2) + 2 * (words % 4) + i % 2


@triton.jit(do_not_specialize=["m", "group_size"])
def _int4_dequant_dot_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [N, K/8] int32
    scales_ptr,  # [N, G]
    zeros_ptr,  # [N, G] uint8 with HAS_ZEROS; any pointer otherwise
    bias_ptr,  # [N] with HAS_BIAS
    out_ptr,  # [M, N]
    n,
    k,
    stride_x_row,
    stride_qweight_row,
    stride_scales_row,
    stride_zeros_row,
    stride_out_row,
    m,
    g_idx_ptr,  # [K] int32 with HAS_G_IDX
    group_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,  # packed words per weight row per K step: the step is 8 * WORDS columns
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # read for float32 operands only
    INTERPRETED: tl.constexpr,  # TRITON_INTERPRET: tl.dot on float32 tiles (see triton_linear)
):
    """Nibble by nibble: nibble i of the step's words [BN, W] holds the columns
    `_nibble_columns(i)`, so it multiplies those x columns, and the 8 products add up to the
    step's; no tile is reshaped. The weight is made whole and rounded to x's dtype as the
    reference does, 2**23 + q giving q - z with one subtraction (no integer-to-float
    conversion)."""
    # Row tiles vary fastest: the programs that share a weight block run side by side, so it
    # comes from HBM once and from L2 for the others.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    words = tl.arange(0, WORDS)  # [W]
    row_valid = rows < m
    col_valid = cols < n
    x_rows = x_ptr + rows[:, None] * stride_x_row  # [BM, 1]
    w_ptrs = qweight_ptr + cols[:, None].to(tl.int64) * stride_qweight_row + words[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)

    for k_start in range(0, k, 8 * WORDS):
        word_valid = k_start + 8 * words < k  # K % 32 == 0: a chunk is whole or out
        mask = col_valid[:, None] & word_valid[None, :]  # [BN, W]
        packed = tl.load(w_ptrs, mask=mask, other=0)
        if not HAS_G_IDX:  # a scale and a zero point per word, for the whole step
            groups = (k_start + 8 * words) // group_size  # [W]
            offsets = cols[:, None] * stride_scales_row + groups[None, :]
            scale = tl.load(scales_ptr + offsets, mask=mask, other=0.0)
            scale = scale.to(tl.float32)
            float_zero = tl.full([BLOCK_N, WORDS], 8.0 + 8388608.0, tl.float32)
            if HAS_ZEROS:
                offsets = cols[:, None] * stride_zeros_row + groups[None, :]
                zero = tl.load(zeros_ptr + offsets, mask=mask, other=0).to(tl.float32)
                float_zero = zero + 8388608.0  # 2**23 + z
        for i in tl.static_range(8):
            ks = _nibble_columns(k_start, words, i)  # [W]
            x_mask = row_valid[:, None] & word_valid[None, :]
            x = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)  # [BM, W]
            q = (packed >> (4 * i)) & 0xF  # [BN, W] int32
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
            if INTERPRETED:
                acc = tl.dot(
                    x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee"
                )
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        w_ptrs += WORDS

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
    BLOCK_K: tl.constexpr,
    TILE_GROUP: tl.constexpr,  # the group size where it divides BLOCK_K (0: by column)
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
):
    """out = the dequantized weight, rounded to out's dtype (the reference's rounding), one
    weight row a program, BLOCK_K columns. The row's words come in one vector load; their
    nibbles [words, 8] are put in column order in registers: column 8p + 2c + h of a chunk is
    nibble 2p + h of its word c (the chunk interleave), so [chunk, c, p, h] permuted to
    [chunk, p, c, h]. Scales and zero points come one a group where groups tile the block,
    else (act-order, a group per row) one a column."""
    row = tl.program_id(0).to(tl.int64)
    words = tl.program_id(1) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    packed = tl.load(qweight_ptr + row * stride_qweight_row + words, mask=words < k // 8, other=0)
    nibbles = (packed[:, None] >> (tl.arange(0, 8) * 4)[None, :]) & 0xF  # [W, 8]: 2p + h
    nibbles = tl.permute(tl.reshape(nibbles, [BLOCK_K // _CHUNK, 4, 4, 2]), (0, 2, 1, 3))
    qf = (tl.reshape(nibbles, [BLOCK_K]) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    if TILE_GROUP > 0:
        groups = tl.program_id(1) * (BLOCK_K // TILE_GROUP) + tl.arange(0, BLOCK_K // TILE_GROUP)
        group_valid = groups * TILE_GROUP < k
    else:
        if HAS_G_IDX:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
            groups = tl.load(g_idx_ptr + ks, mask=ks < k, other=0)
        else:
            groups = ks // group_size
        group_valid = ks < k
    scale = tl.load(scales_ptr + row * stride_scales_row + groups, mask=group_valid).to(tl.float32)
    zero = tl.full(groups.shape, 8.0, tl.float32)
    if HAS_ZEROS:
        zero_ptrs = zeros_ptr + row * stride_zeros_row + groups
        zero = tl.load(zero_ptrs, mask=group_valid, other=0).to(tl.float32)
    if TILE_GROUP > 0:
        qf = tl.reshape(qf, [BLOCK_K // TILE_GROUP, TILE_GROUP])
        w = tl.reshape((qf - zero[:, None]) * scale[:, None], [BLOCK_K])
    else:
        w = (qf - zero) * scale
    out_ptrs = out_ptr + row * stride_out_row + ks
    tl.store(out_ptrs, w.to(out_ptr.dtype.element_ty), mask=ks < k)


def dequantize_int4(
    qweight: torch.Tensor,  # [N, K/8] int32
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None,  # [N, G] uint8
    group_size: int,
    g_idx: torch.Tensor | None,  # [K] int32
    dtype: torch.dtype,
    out: torch.Tensor | None = None,  # [N, K] of dtype, rows contiguous
) -> torch.Tensor:  # [N, K]
    """`kernels.int4.dequantize_int4_reference`, rounded to `dtype`, in one launch."""
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    out = torch.empty((n, k), dtype=dtype, device=qweight.device) if out is None else out
    block_k = min(DEQUANTIZE_BLOCK_K, triton.next_power_of_2(k))
    tile_group = group_size if g_idx is None and block_k % group_size == 0 else 0
    _dequantize_kernel[(n, triton.cdiv(k, block_k))](
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
        BLOCK_K=block_k,
        TILE_GROUP=tile_group,
        HAS_ZEROS=zeros is not None,
        HAS_G_IDX=g_idx is not None,
        num_warps=4,
    )
    return out


def launch_dequant_dot(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    g_idx: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    tiles: Int4Tiles,
) -> None:
    if tiles.block_k < 8 * DOT_MIN:
        raise ValueError(f"{tiles}: tl.dot needs block_k >= {8 * DOT_MIN} (16 words)")
    if min(tiles.block_m, tiles.block_n) < DOT_MIN:
        raise ValueError(f"{tiles}: tl.dot needs block_m and block_n >= {DOT_MIN}")
    m, n = x.shape[0], qweight.shape[0]
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _int4_dequant_dot_kernel[grid](
        *operands(x, qweight, scales, zeros, bias, out),
        m,
        g_idx if g_idx is not None else qweight,
        group_size,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        WORDS=tiles.block_k // PACK,
        HAS_ZEROS=zeros is not None,
        HAS_G_IDX=g_idx is not None,
        HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        INTERPRETED=not x.is_cuda,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def dequantized_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    g_idx: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [M, N]
    """x times the weight dequantized to x's dtype, by cuBLAS: whole past SLICED_MAX_ROWS
    rows, else a slice of the weight's rows at a time (the module's docstring)."""
    m, n, k = x.shape[0], qweight.shape[0], x.shape[1]
    rows = DEQUANTIZE_SLICE_BYTES // (k * x.element_size())  # 0: whole
    rows -= rows % SLICE_ROWS_MULTIPLE
    if m > SLICED_MAX_ROWS or rows == 0 or rows >= n:
        weight = dequantize_int4(qweight, scales, zeros, group_size, g_idx, x.dtype)
        return torch.nn.functional.linear(x, weight, bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    scratch = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    for start in range(0, n, rows):
        part = slice(start, min(n, start + rows))
        weight = dequantize_int4(
            qweight[part], scales[part], None if zeros is None else zeros[part], group_size,
            g_idx, x.dtype, out=scratch[: part.stop - start],
        )  # fmt: skip
        if bias is None:
            torch.mm(x, weight.t(), out=out[:, part])
        else:
            torch.addmm(bias[part], x, weight.t(), out=out[:, part])
    return out
