"""int4 weight-only linear layers in Triton: the packed weight dequantized in registers.

Same layout as `kernels.int4` (read its docstring: words interleaved in chunks of 32 columns).
Three kernels:

- **One row per program** (decode: up to GEMV_MAX_ROWS rows, without act-order). A program
  owns BLOCK_N weight rows and walks K; each thread holds whole chunks (4 words) of its rows
  and the x values they multiply, read as 16-bit pairs by one vector load per nibble pair,
  so no tile changes layout between threads until the final sum. The multiply-adds run on
  the CUDA cores, and their count is the limit: a nibble costs a shift, a mask and an FMA.
- **tl.dot tiles of 16 rows** (more rows, or act-order): the nibbles of the step's words
  multiply the x columns they hold, nibble by nibble.
- Past 64 rows the weight is dequantized to the activation's dtype by a third kernel, then
  multiplied by cuBLAS.

Scales and zero points: without act-order, one per packed word (a word's 8 columns share a
group), applied after the word's sum, in float32, so the result is closer to the exact
product than the reference, which rounds each dequantized weight to the activation's dtype
first (the tests allow for that). With act-order, one per column, gathered by g_idx, the
weight made whole and rounded as the reference does.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.int4 import CHUNK, PACK

DOT_MIN = 16  # tl.dot needs every dimension >= 16
_CHUNK = tl.constexpr(CHUNK)
DEQUANTIZE_ABOVE_ROWS = 64
GEMV_MAX_ROWS = 4  # the row kernel's limit (default_tiles)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Int4Tiles:
    block_m: int  # rows per program: 1 for the row kernel, at least 16 with use_dot
    block_n: int
    block_k: int  # columns per K step: 8 x a power of two words; >= 128 for tl.dot
    num_warps: int
    num_stages: int
    use_dot: bool  # False: the row kernel (one row of x per program, no act-order)


def default_tiles(m: int, n: int, k: int) -> Int4Tiles:
    """benchmarks/int4_sweep.py's picks (H200, Llama-3.1-8B shapes, groups of 128, 2026-11-26;
    docs/benchmarks.md has the table). One row: the row kernel with 8 weight rows and 2048
    columns a step over 2 warps; 2-4 rows: 4 weight rows and 1024 columns, one warp (a thread
    then holds all 4 rows of its chunks and reads each x pair once for them), except for the
    widest layer (gate_up), where the row kernel's cost per row shows first. From there,
    tl.dot tiles of 16 rows (side by side past 16: tiles of 64 measured 2-4x slower) with steps
    of 128 columns, which lie inside a group of 128 and so take 128 + q as the operand."""
    wide = n >= 16384
    if m == 1:
        return Int4Tiles(1, 8, min(2048, triton.next_power_of_2(k)), 2, 1, use_dot=False)
    if m <= GEMV_MAX_ROWS and not wide:
        return Int4Tiles(1, 4, min(1024, triton.next_power_of_2(k)), 1, 1, use_dot=False)
    if wide:
        return Int4Tiles(16, 128, 128, num_warps=8, num_stages=3, use_dot=True)
    return Int4Tiles(16, 64, 128, num_warps=4, num_stages=4, use_dot=True)


@triton.jit
def _one_plus_q16(packed, i: tl.constexpr):
    """1 + q/16 in float32 for nibble i of each word: its 4 bits moved to the top of the
    mantissa under 1.0's exponent, with one shift and one mask-and-or (an integer-to-float
    conversion would be a slow instruction, and subtracting the offset another op)."""
    if 4 * i <= 19:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
        moved = packed << (19 - 4 * i)
    else:  # arithmetic shift: its sign bits land above the mask
        moved = packed >> (4 * i - 19)
    return ((moved & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _x_pair(x_row, k_start, words, word_valid, p: tl.constexpr, X_PAIRS: tl.constexpr):
    """The x values [1, W] that nibbles 2p and 2p + 1 of each word multiply, as float32: the
    chunk's columns 8p + 2c and 8p + 2c + 1 for word c. X_PAIRS (1 bf16, 2 fp16) reads them as
    one int32 each, four words' pairs contiguous (the layout's point); 0 reads them one by
    one (float32 x, or an x that is not 4-byte aligned)."""
    pair = (words // 4) * (_CHUNK // 2) + 4 * p + words % 4  # [W] pairs from the step's start
    if X_PAIRS == 0:
        offsets = (k_start + 2 * pair)[None, :]
        lo = tl.load(x_row + offsets, mask=word_valid, other=0.0).to(tl.float32)
        hi = tl.load(x_row + offsets + 1, mask=word_valid, other=0.0).to(tl.float32)
    else:
        pairs = x_row.to(tl.pointer_type(tl.int32)) + k_start // 2
        xp = tl.load(pairs + pair[None, :], mask=word_valid, other=0)
        if X_PAIRS == 1:  # bf16 is float32's top half
            lo = (xp << 16).to(tl.float32, bitcast=True)
            hi = (xp & -65536).to(tl.float32, bitcast=True)
        else:
            lo = xp.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (xp >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _int4_row_kernel(
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
    GROUP_SIZE: tl.constexpr,  # a constant, so that a word's group costs no division
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,  # packed words per weight row per K step: 8 * WORDS columns
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    X_PAIRS: tl.constexpr,  # see _x_pair
    EVEN_K: tl.constexpr,  # K % (8 * WORDS) == 0: no step needs a mask along K
):
    """out[row, cols] for one row of x. A word's sum is sum x (q - z) = 16 sum x v - (16 + z)
    sum x with v = 1 + q/16 (_one_plus_q16): one FMA a nibble, and the x sum shared by the
    program's rows."""
    # Row programs vary fastest: the programs that share a weight block run side by side, so it
    # comes from HBM once and from L2 for the others.
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    words = tl.arange(0, WORDS)  # [W]
    col_valid = cols < n
    w_ptrs = qweight_ptr + cols[:, None].to(tl.int64) * stride_qweight_row + words[None, :]
    x_row = x_ptr + row * stride_x_row
    acc = tl.zeros([BLOCK_N, WORDS], tl.float32)
    for k_start in range(0, k, 8 * WORDS):
        # K % 32 == 0: a chunk is whole or out, and a mask by chunks keeps vector loads.
        if EVEN_K:
            word_valid = tl.full([1, WORDS], True, tl.int1)
        else:
            word_valid = (k_start + (words // 4) * _CHUNK < k)[None, :]  # [1, W], by chunks
        mask = col_valid[:, None] & word_valid
        packed = tl.load(w_ptrs, mask=mask, other=0)  # [BN, W]
        groups = (k_start + 8 * words) // GROUP_SIZE  # [W]
        offsets = cols[:, None] * stride_scales_row + groups[None, :]
        scale = tl.load(scales_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        offset = tl.full([BLOCK_N, WORDS], 16.0 + 8.0, tl.float32)  # 16 + z
        if HAS_ZEROS:
            offsets = cols[:, None] * stride_zeros_row + groups[None, :]
            offset = tl.load(zeros_ptr + offsets, mask=mask, other=0).to(tl.float32) + 16.0
        step = tl.zeros([BLOCK_N, WORDS], tl.float32)
        x_sum = tl.zeros([1, WORDS], tl.float32)
        for p in tl.static_range(4):
            lo, hi = _x_pair(x_row, k_start, words, word_valid, p, X_PAIRS)
            x_sum += lo + hi
            step += _one_plus_q16(packed, 2 * p) * lo
            step += _one_plus_q16(packed, 2 * p + 1) * hi
        acc += (16.0 * step - offset * x_sum) * scale
        w_ptrs += WORDS

    out = tl.sum(acc, axis=1)  # [BN]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=col_valid
    )


@triton.jit
def _nibble_columns(k_start, words, i: tl.constexpr):
    """The columns [W] that nibble i of the step's words hold (the chunk interleave)."""
    return k_start + (words // 4) * _CHUNK + 8 * (i // 2) + 2 * (words % 4) + i % 2


@triton.jit(do_not_specialize=["m", "group_size"])
def _int4_dot_kernel(
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
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MAGIC: tl.constexpr,  # 0, or the bits of 128.0 (bf16) / 1024.0 (fp16), for steps that
    #                       lie inside one group: see below
    DOT_PRECISION: tl.constexpr,  # read for float32 operands only
    INTERPRETED: tl.constexpr,  # TRITON_INTERPRET: tl.dot on float32 tiles (see triton_linear)
):
    """Nibble by nibble: nibble i of the step's words [BN, W] holds the columns
    `_nibble_columns(i)`, so it multiplies those x columns, and the 8 products add up to the
    step's; no tile is reshaped. MAGIC: OR-ing a nibble q into the bits of 128.0 gives the
    bf16 number 128 + q, tl.dot's operand as is; the offset and the zero point come off the
    step's sum once, as sum x (128 + q) - (128 + z) sum x. Otherwise (a step across groups,
    act-order, float32) the weight is made whole and rounded to x's dtype as the reference
    does, 2**23 + q giving q - z with one subtraction."""
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
        if MAGIC != 0:  # the step lies inside one group: a scale and zero point per column
            group = k_start // group_size
            scale_ptrs = scales_ptr + cols * stride_scales_row + group
            step_scale = tl.load(scale_ptrs, mask=col_valid, other=0.0).to(tl.float32)  # [BN]
            step_zero = tl.full([BLOCK_N], 8.0, tl.float32)
            if HAS_ZEROS:
                zero_ptrs = zeros_ptr + cols * stride_zeros_row + group
                step_zero = tl.load(zero_ptrs, mask=col_valid, other=0).to(tl.float32)
            step_offset = step_zero + (128.0 if MAGIC == 0x4300 else 1024.0)
            step = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            x_sum = tl.zeros([BLOCK_M, WORDS], tl.float32)
        elif not HAS_G_IDX:  # a scale and a zero point per word, for the whole step
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
            if MAGIC != 0:
                w = (q | MAGIC).to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True)
                step = tl.dot(x, tl.trans(w), step)
                x_sum += x.to(tl.float32)
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
                if INTERPRETED:
                    acc = tl.dot(
                        x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee"
                    )
                else:
                    acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if MAGIC != 0:
            x_total = tl.sum(x_sum, axis=1)  # [BM]
            acc += (step - x_total[:, None] * step_offset[None, :]) * step_scale[None, :]
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
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
):
    """out = the dequantized weight, rounded to out's dtype (the reference's rounding). The
    tile is unpacked as [BN, W, 8], flattened to its packed positions [BN, 8 W], and stored at
    their columns (the chunk interleave: a permutation inside the tile's columns)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] weight rows
    words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)  # [W]
    positions = tl.arange(0, WORDS * 8)  # [8 W] packed positions 8 w + i in the tile
    within = positions % _CHUNK  # 8 c + 2 p + h -> column 8 p + 2 c + h of the chunk
    chunk_column = 8 * ((within % 8) // 2) + 2 * (within // 8) + within % 2
    ks = tl.program_id(1) * WORDS * 8 + (positions // _CHUNK) * _CHUNK + chunk_column  # [8 W]
    row_valid = cols < n
    offsets = cols[:, None].to(tl.int64) * stride_qweight_row + words[None, :]
    packed = tl.load(qweight_ptr + offsets, mask=row_valid[:, None] & (words < k // 8)[None, :])
    q = (packed[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF  # [BN, W, 8]
    q = tl.reshape(q, [BLOCK_N, WORDS * 8])  # packed position 8 w + i
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
    if k % CHUNK or (g_idx is None and group_size % CHUNK):
        raise ValueError(f"K={k} and the group size {group_size} must be multiples of {CHUNK}")
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
    if not tiles.use_dot and g_idx is not None:
        tiles = default_tiles(max(m, GEMV_MAX_ROWS + 1), n, k)  # act-order: the dot kernel
    if tiles.use_dot:
        _launch_dot(x, qweight, scales, zeros, group_size, g_idx, bias, out, tiles)
    else:
        _launch_rows(x, qweight, scales, zeros, group_size, bias, out, tiles)
    return out


def _launch_rows(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    tiles: Int4Tiles,
) -> None:
    if tiles.block_m != 1 or tiles.block_k % CHUNK:
        raise ValueError(f"{tiles}: the row kernel takes block_m 1 and whole chunks along K")
    m, n, k = x.shape[0], qweight.shape[0], x.shape[1]
    # 16-bit x read as int32 pairs where its rows are 4-byte aligned.
    aligned = x.data_ptr() % 4 == 0 and x.stride(0) % 2 == 0
    x_pairs = {torch.bfloat16: 1, torch.float16: 2}.get(x.dtype, 0) if aligned else 0
    _int4_row_kernel[(m, triton.cdiv(n, tiles.block_n))](
        x,
        qweight,
        scales,
        zeros if zeros is not None else scales,
        bias if bias is not None else scales,
        out,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        out.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_N=tiles.block_n,
        WORDS=tiles.block_k // PACK,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None,
        X_PAIRS=x_pairs,
        EVEN_K=k % tiles.block_k == 0,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def _launch_dot(
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
    m, n, k = x.shape[0], qweight.shape[0], x.shape[1]
    magic = {torch.bfloat16: 0x4300, torch.float16: 0x6400}.get(x.dtype, 0)
    magic = magic if x.is_cuda else 0  # bf16 tl.dot: see triton_linear
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _int4_dot_kernel[grid](
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
        WORDS=tiles.block_k // PACK,
        HAS_ZEROS=zeros is not None,
        HAS_G_IDX=g_idx is not None,
        HAS_BIAS=bias is not None,
        MAGIC=magic if g_idx is None and group_size % tiles.block_k == 0 else 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        INTERPRETED=not x.is_cuda,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
