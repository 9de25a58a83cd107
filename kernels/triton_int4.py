"""int4 weight-only linear layers in Triton: the packed weight dequantized in registers.

Same layout as `kernels.int4` (read its docstring: words interleaved in chunks of 32 columns).
Up to DEQUANTIZE_ABOVE_ROWS rows one launch, of one of three kernels (`Int4Tiles.kind`,
picked by `default_tiles`):

- **dot** (1-64 rows; 16-bit x, groups of a multiple of 128, no act-order): out^T = W x^T,
  the weight tl.dot's first operand, made in registers from its words: nibbles 2p and 2p + 1
  joined as neighbours along K take the chunk's columns 8p .. 8p + 7 (the layout's point), so
  x comes in runs of 8 columns, by asynchronous copies. A step is 128 columns inside one
  group; on the GPU each pair of nibbles becomes q - z in x's dtype by three instructions of
  inline PTX (kernels/int4_pairs.py), so the tensor cores take the exact integer and the scale
  multiplies the step's float32 sum. The kernel launches with PDL (kernels.triton_pdl).
- **rows** (up to 4 rows where "dot" does not apply: float32 x, groups of 32 or 64, K not
  a multiple of 128; no act-order): a program per row of x owns BLOCK_N weight rows and walks
  K; each thread holds whole chunks (4 words) of its rows and the x values they multiply,
  read as 16-bit pairs by one vector load per nibble pair, so no tile changes layout between
  threads until the final sum. The multiply-adds run on the CUDA cores: a nibble costs a
  shift, a mask and an FMA.
- **dequant_dot** (the rest: act-order, groups of 32 or 64, float32): x tl.dot's first
  operand, the weight made whole and rounded to x's dtype, nibble by nibble
  (kernels/triton_int4_dequant.py).

Past DEQUANTIZE_ABOVE_ROWS rows the weight is dequantized to the activation's dtype by a
fourth kernel (kernels/triton_int4_dequant.py), then multiplied by cuBLAS; on Hopper, with
kernels.gluon_int4.ENABLED, up to its MAX_ROWS a Gluon kernel on the warpgroup MMA instead.

Scales and zero points: in the dot and rows kernels one per step or packed word (a word's 8
columns share a group). The dot kernel takes the zero point off each weight, exactly, and the
rows kernel off each word's sum; both apply the scale after the sum, in float32, so the
result is closer to the exact product than the reference, which rounds each dequantized
weight to the activation's dtype first (the tests allow for that). dequant_dot makes the
weight whole and rounds it as the reference does, with act-order by each column's group,
gathered by g_idx.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import gluon_int4
from kernels import triton_split_k as split_k
from kernels.int4 import CHUNK, PACK, Int4Tiles
from kernels.int4_pairs import BF16_PAIRS_ASM, FP16_PAIRS_ASM
from kernels.triton_int4_dequant import dequantized_linear, launch_dequant_dot, operands
from kernels.triton_pdl import (
    L2_LINE_BYTES,
    launches_early,
    prefetch_to_l2,
    wait_for_previous_kernel,
)
from kernels.triton_split_k import sum_of_splits

_CHUNK = tl.constexpr(CHUNK)
_LINE_WORDS = tl.constexpr(L2_LINE_BYTES // 4)  # packed words in a 128-byte line
DEQUANTIZE_ABOVE_ROWS = 64  # past this the weight is dequantized, then cuBLAS
DOT_STEP = 128  # the dot kernel's K step: one group of 128 (or a part of a larger one)
DOT_WARPS = 2048  # the dot kernel splits K until about this many warps run,
DOT_MIN_ITERATIONS = 8  # leaving each split at least this many loop iterations,
DOT_MAX_SPLIT = 8  # in at most this many parts
WIDE_N = 16384  # gate_up-like layers: N >= this
WIDE_K = 8192  # down-like layers: K >= this
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dot_applies(dtype: torch.dtype, group_size: int, act_order: bool) -> bool:
    """Whether the dot kernel can run: a 16-bit x (the q - z operand), steps inside one
    group, no act-order."""
    return dtype in (torch.bfloat16, torch.float16) and group_size % DOT_STEP == 0 and not act_order


def default_tiles(m: int, n: int, k: int, dot: bool = True, act_order: bool = False) -> Int4Tiles:
    """sweeps/int4_sweep.py's picks (H100, Llama-3.1-8B shapes, groups of 128,
    2026-11-28; docs/benchmarks-history.md has the table). `dot`: whether `dot_applies`.

    - With "dot", x tiles of 8 rows up to 8 rows: 32 weight rows over 2 warps, K steps of 128;
      for gate_up and down (N >= WIDE_N or K >= WIDE_K) 64 weight rows over 4 warps, two steps
      an iteration. 9-16 rows: 16 x 64 over 4 warps; 17-64 rows: 32 x 128 over 8 warps (the
      16 x 64 tile converted each weight once per 16 rows: gate_up at 32 rows 54.8 against
      40.2 us). K is split until about DOT_WARPS warps run, leaving each split at least
      DOT_MIN_ITERATIONS iterations. At one row, us per layer: qkv 9.6, o 8.0, gate_up 30.9, down
      21.0 (the rows kernel: 12.4, 9.4, 43.2, 25.6; PyTorch's int4 GEMM 10.2, 7.1, 33.0, 18.8).
    - Without "dot": "rows" with 8 weight rows and 2048 columns a step over 2 warps at one row,
      4 rows and 1024 columns over one warp up to 4 rows (but for the widest layer, gate_up),
      then dequant_dot tiles of 16 rows with steps of 128, which act-order takes at any row
      count."""
    wide = n >= WIDE_N
    if not act_order and dot:
        block_m, block_n, block_k, warps = _dot_tile(m, n, k)
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        wanted = max(1, min(DOT_WARPS // warps // tiles, k // block_k // DOT_MIN_ITERATIONS))
        split = min(DOT_MAX_SPLIT, 1 << (wanted.bit_length() - 1))  # a power of two
        return Int4Tiles("dot", block_m, block_n, block_k, warps, 3, split)
    if not act_order and m == 1:
        return Int4Tiles("rows", 1, 8, min(2048, triton.next_power_of_2(k)), 2, 1)
    if not act_order and m <= 4 and not wide:
        return Int4Tiles("rows", 1, 4, min(1024, triton.next_power_of_2(k)), 1, 1)
    if wide:
        return Int4Tiles("dequant_dot", 16, 128, 128, num_warps=8, num_stages=3)
    return Int4Tiles("dequant_dot", 16, 64, 128, num_warps=4, num_stages=4)


def _dot_tile(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """The dot kernel's (block_m, block_n, block_k, num_warps) for M rows (default_tiles)."""
    if m > 16:
        return 32, 128, DOT_STEP, 8
    if m > 8:
        return 16, 64, DOT_STEP, 4
    if n >= WIDE_N or k >= WIDE_K:  # gate_up, down
        return 8, 64, 2 * DOT_STEP, 4
    return 8, 32, DOT_STEP, 2


@triton.jit
def one_plus_q16(packed, i: tl.constexpr):
    """1 + q/16 in float32 for nibble i of each word: its 4 bits moved to the top of the
    mantissa under 1.0's exponent, with one shift and one mask-and-or (an integer-to-float
    conversion would be a slow instruction, and subtracting the offset another op)."""
    if 4 * i <= 19:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
        moved = packed << (19 - 4 * i)
    else:  # arithmetic shift: its sign bits land above the mask
        moved = packed >> (4 * i - 19)
    return ((moved & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def x_pair(x_row, k_start, words, word_valid, p: tl.constexpr, X_PAIRS: tl.constexpr):
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
    X_PAIRS: tl.constexpr,  # see x_pair
    EVEN_K: tl.constexpr,  # K % (8 * WORDS) == 0: no step needs a mask along K
):
    """out[row, cols] for one row of x. A word's sum is sum x (q - z) = 16 sum x v - (16 + z)
    sum x with v = 1 + q/16 (one_plus_q16): one FMA a nibble, and the x sum shared by the
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
            lo, hi = x_pair(x_row, k_start, words, word_valid, p, X_PAIRS)
            x_sum += lo + hi
            step += one_plus_q16(packed, 2 * p) * lo
            step += one_plus_q16(packed, 2 * p + 1) * hi
        acc += (16.0 * step - offset * x_sum) * scale
        w_ptrs += WORDS

    out = tl.sum(acc, axis=1)  # [BN]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=col_valid
    )


@triton.jit
def _q_minus_z(packed, i: tl.constexpr, zero):
    """q - z of nibble i of each word [BN, W], in float32 (the interpreter's path)."""
    return ((packed >> (4 * i)) & 0xF).to(tl.float32) - zero[:, None]


@triton.jit
def q_minus_z_pairs(packed, zero, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """q - z of every nibble, in `dtype` (bf16 or fp16; exact for the zero points 0..15
    that the loaders keep), as four [BN, W, 2] tiles: tile p holds nibbles 2p and 2p + 1 of
    each word side by side. zero: [BN] float32. On the GPU two values cost a PRMT, a LOP3
    and a packed FMA (kernels/int4_pairs.py); the interpreter, which runs no assembly, gets there
    nibble by nibble."""
    if INTERPRETED:
        return (
            tl.join(_q_minus_z(packed, 0, zero), _q_minus_z(packed, 1, zero)).to(dtype),
            tl.join(_q_minus_z(packed, 2, zero), _q_minus_z(packed, 3, zero)).to(dtype),
            tl.join(_q_minus_z(packed, 4, zero), _q_minus_z(packed, 5, zero)).to(dtype),
            tl.join(_q_minus_z(packed, 6, zero), _q_minus_z(packed, 7, zero)).to(dtype),
        )
    base = 1024.0 if dtype == tl.float16 else 128.0
    minus_offset = (-(zero + base)).to(dtype)[:, None]  # [BN, 1], 16-bit: packed in pairs
    asm: tl.constexpr = FP16_PAIRS_ASM if dtype == tl.float16 else BF16_PAIRS_ASM
    return tl.inline_asm_elementwise(
        asm,
        "=r,=r,=r,=r,r,r,r",
        [tl.join(packed, packed >> 4), tl.join(minus_offset, minus_offset)],
        dtype=(dtype.value, dtype.value, dtype.value, dtype.value),  # constexpr: unwrapped
        is_pure=True,
        pack=2,
    )


@triton.jit(do_not_specialize=["m"])
def _int4_dot_kernel(
    x_ptr,  # [M, K] bf16 or fp16
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
    partials_ptr,  # [SPLIT_K, M, N] float32 with SPLIT_K > 1
    tickets_ptr,  # [tiles] int32, zero between calls, with SPLIT_K > 1
    GROUP_SIZE: tl.constexpr,  # a multiple of the step (8 * WORDS)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,  # packed words per weight row per K step
    UNROLL: tl.constexpr,  # K steps per loop iteration
    SPLIT_K: tl.constexpr,  # programs along K per output tile
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRETED: tl.constexpr,  # TRITON_INTERPRET: float32 dots (see triton_linear)
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
    PREFETCH_LINES: tl.constexpr,  # with PDL: the 128-byte lines of its first steps a row
):
    """out[rows, cols]^T = sum over steps of W_step x_step^T. In a step, for each nibble pair
    p the weight tile [BN, 2W] is q - z of nibbles 2p and 2p + 1 of each word side by side
    (q_minus_z_pairs), which hold the chunk's columns 8p .. 8p + 7, and x^T [2W, BM] those
    columns: runs of 8. The tensor cores sum the exact integers times x in float32; the
    group's scale multiplies the step's sum. UNROLL steps an iteration (each inside one
    group); an iteration's steps past the split's end load nothing.

    SPLIT_K: the tile's steps are shared by SPLIT_K programs (narrow layers have too few
    tiles to fill the GPU, and each would walk all of K). Each writes its partial sum; the
    last to finish, told by a ticket counter, adds them in split order (the same sum every
    time, whichever finishes last), writes the tile and resets the counter."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] weight rows
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows of x
    words = tl.arange(0, WORDS)
    pair_k = tl.arange(0, 2 * WORDS)  # the weight tile's K index 2 w + h
    col_valid = cols < n
    row_valid = rows < m
    w_ptrs = qweight_ptr + cols[:, None].to(tl.int64) * stride_qweight_row + words[None, :]
    x_rows = x_ptr + rows[None, :] * stride_x_row  # [1, BM]
    x_cols = (pair_k // 8) * _CHUNK + pair_k % 8  # [2W]: chunk w // 4, column 2 (w % 4) + h
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    steps = tl.cdiv(k // (8 * WORDS), SPLIT_K)  # K % step == 0: checked by the launcher
    split = tl.program_id(2)
    k_begin = split * steps * 8 * WORDS
    k_end = tl.minimum(k_begin + steps * 8 * WORDS, k)
    w_ptrs += split * steps * WORDS
    if PREFETCH_LINES > 0:  # into L2 while the previous kernel ends (safe: kernels.triton_pdl)
        lines = tl.arange(0, PREFETCH_LINES) * _LINE_WORDS  # [L]
        first = tl.minimum(split * steps * WORDS + lines, k // 8 - 1)
        rows_first = tl.minimum(cols, n - 1).to(tl.int64) * stride_qweight_row
        prefetch_to_l2(qweight_ptr + rows_first[:, None] + first[None, :])
    wait_for_previous_kernel(PDL)
    for k_start in range(k_begin, k_end, 8 * WORDS * UNROLL):
        for u in tl.static_range(UNROLL):  # a step each; past the split's end, masked out
            k_step = k_start + u * 8 * WORDS
            valid = tl.full([1], k_step, tl.int32) < k_end  # [1]
            w_mask = col_valid[:, None] & valid[None, :]
            packed = tl.load(w_ptrs + u * WORDS, mask=w_mask, other=0)
            group = k_step // GROUP_SIZE
            scale_ptrs = scales_ptr + cols * stride_scales_row + group
            scale = tl.load(scale_ptrs, mask=col_valid & valid, other=0.0).to(tl.float32)
            zero = tl.full([BLOCK_N], 8.0, tl.float32)
            if HAS_ZEROS:
                zero_ptrs = zeros_ptr + cols * stride_zeros_row + group
                zero = tl.load(zero_ptrs, mask=col_valid & valid, other=0).to(tl.float32)
            pairs = q_minus_z_pairs(packed, zero, x_ptr.dtype.element_ty, INTERPRETED)
            step = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for p in tl.static_range(4):
                x_ptrs = x_rows + (k_step + 8 * p + x_cols)[:, None]
                xt = tl.load(x_ptrs, mask=row_valid[None, :] & valid[:, None], other=0.0)
                weight = tl.reshape(pairs[p], [BLOCK_N, 2 * WORDS])
                if INTERPRETED:
                    step = tl.dot(
                        weight.to(tl.float32), xt.to(tl.float32), step, input_precision="ieee"
                    )
                else:
                    step = tl.dot(weight, xt, step)
            acc += step * scale[:, None]
        w_ptrs += WORDS * UNROLL

    mask = col_valid[:, None] & row_valid[None, :]  # [BN, BM]
    if SPLIT_K > 1:
        acc, last = sum_of_splits(acc, partials_ptr, tickets_ptr, rows, cols, mask, m, n, SPLIT_K)
        if not last:
            return
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows[None, :] * stride_out_row + cols[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


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
    if k == 0 or k % CHUNK or (g_idx is None and group_size % CHUNK):
        raise ValueError(
            f"K={k} and the group size {group_size} must be positive multiples of {CHUNK}"
        )
    if g_idx is not None and (g_idx.shape != (k,) or g_idx.dtype != torch.int32):
        raise ValueError(f"g_idx must be int32 [{k}], got {g_idx.dtype} {tuple(g_idx.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")


_DOT_NEEDS = f"a bf16 or fp16 x, K and the group size multiples of {DOT_STEP}, no g_idx"


def int4_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K/8] int32
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None,  # [N, G] uint8; None: 8
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
    bias: torch.Tensor | None = None,  # [N]
    *,
    tiles: Int4Tiles | None = None,  # None: default_tiles
) -> torch.Tensor:  # [M, N], x.dtype
    """`kernels.int4.int4_linear_reference`: up to DEQUANTIZE_ABOVE_ROWS rows one launch that
    reads the packed weight; past that the weight dequantized to x's dtype, then cuBLAS
    (`dequantized_linear`; on an H200 at Qwen3-8B's shapes the whole pass ran at 0.8-3.6
    TB/s). The dot kernel with 128 x 128
    tiles beat the pass per call at 96 rows (sweeps/int4_sweep.py), yet a whole decode step of
    96 rows was 3 % slower with it (H200, 2026-12-05: 11.55 against 11.22 ms), so the bound
    stays at 64."""
    _check_inputs(x, qweight, scales, zeros, group_size, g_idx, bias)
    m, n, k = x.shape[0], qweight.shape[0], x.shape[1]
    if tiles is None and m > DEQUANTIZE_ABOVE_ROWS:
        if wgmma_takes(x, qweight, scales, group_size, g_idx):
            return gluon_int4.gluon_int4_linear(x, qweight, scales, zeros, group_size, None, bias)
        return dequantized_linear(x, qweight, scales, zeros, group_size, g_idx, bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    dot = dot_applies(x.dtype, group_size, g_idx is not None) and k % DOT_STEP == 0
    tiles = tiles or default_tiles(m, n, k, dot, act_order=g_idx is not None)
    if tiles.kind == "dot" and not dot:
        raise ValueError(f"{tiles}: the dot kernel needs {_DOT_NEEDS}")
    launch = {"rows": _launch_rows, "dot": _launch_dot, "dequant_dot": launch_dequant_dot}
    launch[tiles.kind](x, qweight, scales, zeros, group_size, g_idx, bias, out, tiles)
    return out


def wgmma_takes(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None,
) -> bool:
    """Whether rows past DEQUANTIZE_ABOVE_ROWS go to the Gluon kernel (kernels/gluon_int4.py)."""
    return (
        gluon_int4.ENABLED
        and x.shape[0] <= gluon_int4.MAX_ROWS
        and gluon_int4.applies(x, qweight, scales, group_size, g_idx)
    )


def _launch_rows(
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
    if tiles.block_m != 1 or tiles.block_k % CHUNK:
        raise ValueError(f"{tiles}: the rows kernel takes block_m 1 and whole chunks along K")
    if g_idx is not None:
        raise ValueError(f"{tiles}: the rows kernel does not take act-order (g_idx)")
    m, n, k = x.shape[0], qweight.shape[0], x.shape[1]
    # 16-bit x read as int32 pairs where its rows are 4-byte aligned.
    aligned = x.data_ptr() % 4 == 0 and x.stride(0) % 2 == 0
    x_pairs = {torch.bfloat16: 1, torch.float16: 2}.get(x.dtype, 0) if aligned else 0
    _int4_row_kernel[(m, triton.cdiv(n, tiles.block_n))](
        *operands(x, qweight, scales, zeros, bias, out),
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
    if tiles.block_k % DOT_STEP:
        raise ValueError(f"{tiles}: the dot kernel takes K steps of {DOT_STEP} columns")
    if g_idx is not None:
        raise ValueError(f"{tiles}: the dot kernel does not take act-order (g_idx)")
    m, n = x.shape[0], qweight.shape[0]
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(m, tiles.block_m), tiles.split_k)
    partials, tickets = split_k.workspace(grid, m, n, out, tiles)
    early = launches_early(x)
    _int4_dot_kernel[grid](
        *operands(x, qweight, scales, zeros, bias, out),
        m,
        partials,
        tickets,
        GROUP_SIZE=group_size,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        WORDS=DOT_STEP // PACK,
        UNROLL=tiles.block_k // DOT_STEP,
        SPLIT_K=tiles.split_k,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None,
        INTERPRETED=not x.is_cuda,
        PDL=early,
        PREFETCH_LINES=_prefetch_lines(tiles) if early else 0,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        launch_pdl=early,
    )


def _prefetch_lines(tiles: Int4Tiles) -> int:
    """The 128-byte lines a program prefetches of each weight row: num_stages steps of 128
    columns (half a byte a column), rounded up to a power of two; the start of what the
    pipeline loads first, which at two steps an iteration is (num_stages - 1) * 2 steps."""
    return triton.next_power_of_2(triton.cdiv(tiles.num_stages * DOT_STEP // 2, L2_LINE_BYTES))
