"""GGUF linear layers in Triton: llama.cpp's blocks dequantized where they are read.

Same layout as `kernels.gguf` (read its docstring): `raw [N, row_bytes] uint8`, the file's
bytes. A program owns [BLOCK_M, BLOCK_N] of the output and walks K in steps of 256 values:
one K-quant block or eight 32-value blocks per row. Each step loads the blocks' bytes whole
(contiguous runs of nibbles; the scales once per block or sub-block) and dequantizes them
into two halves, the values of the low and of the high nibbles, in the order the bytes hold
them; the activations are loaded in that order instead (runs of 16 or 32 consecutive
values), so the weight bytes are read once and never shuffled. Integer values become floats
by the exponent trick (`_exact_float`), not by quarter-rate conversions.

Up to 2 rows, a program per activation row multiplies and adds into a [BLOCK_N, 128]
accumulator summed once at the end (decode); up to 64 rows, tl.dot tiles of 16 rows; past
that the same tiles are written out in the activation's dtype and cuBLAS multiplies. The
weights are float32 in registers (rounded to the activation's dtype for tl.dot), at least as
close to the exact product as the reference.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.gguf import GGUF_TYPES, GgufType, row_bytes

DOT_MIN = 16
FMA_MAX_ROWS = 2
DEQUANTIZE_ABOVE_ROWS = 64
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


STEP_VALUES = 256  # K values per step: one K-quant block, eight 32-value blocks
STEP = tl.constexpr(STEP_VALUES)
HALF = tl.constexpr(128)


@dataclasses.dataclass(frozen=True)
class GgufTiles:
    block_m: int  # 1 without tl.dot (one program per row), else >= 16
    block_n: int
    num_warps: int
    use_dot: bool
    num_stages: int = 3


def default_tiles(m: int) -> GgufTiles:
    """sweeps/gguf_sweep.py's picks (H100, Llama-3.1-8B shapes, Q4_K, Q6_K and Q8_0,
    2026-11-26; docs/benchmarks-history.md has the table): at 1-2 rows a program of one warp per two
    weight rows and activation row (within 9 % of each shape's best on average); from 3 rows
    tl.dot tiles of 16 x 32 (within 5 %)."""
    if m <= FMA_MAX_ROWS:
        return GgufTiles(1, 2, num_warps=1, use_dot=False, num_stages=1)
    return GgufTiles(16, 32, num_warps=4, use_dot=True, num_stages=3)


@triton.jit
def _byte(ptrs, mask):
    return tl.load(ptrs, mask=mask, other=0).to(tl.int32)


@triton.jit
def _exact_float(bits, offset: tl.constexpr):
    """float(bits) - offset for 0 <= bits < 2**23, without an integer-to-float conversion
    (a quarter-rate instruction): bits under the exponent of 2**23, then one exact subtract."""
    return (bits | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def _f16(ptrs, mask):  # the little-endian f16 at ptrs, as float32
    bits = _byte(ptrs, mask) | (_byte(ptrs + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _flat(w_low, w_high, BN: tl.constexpr):
    """Values from the low and the high nibbles, [BN, A, B] each -> [BN, HALF] each."""
    return tl.reshape(w_low, (BN, HALF)), tl.reshape(w_high, (BN, HALF))


@triton.jit
def _legacy_tile(
    rows,
    step,
    k,
    n_mask,
    QTYPE: tl.constexpr,
    BB: tl.constexpr,
    BN: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Eight 32-value blocks of each row (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): values 0-15 and
    16-31 of each block ("low" and "high"), and where they lie along K."""
    b = tl.arange(0, 8)[None, :, None]  # [1, 8, 1]: the block within the step
    base = rows[:, :, None] + (step * 8 + b) * BB  # [BN, 8, 1]
    mask = n_mask[:, :, None] & (EVEN_K or (step * 8 + b) * 32 < k)
    d = _f16(base, mask)
    i = tl.arange(0, 16)[None, None, :]  # byte i: value i (low nibble) and i + 16 (high)
    v = tl.arange(0, HALF)  # the columns of each half: block v // 16, value v % 16
    index = (v // 16) * 32 + v % 16
    if QTYPE == 8:  # Q8_0: 32 int8 values
        # an int8 q is byte - 256 * (byte >= 128), and q + 128 = byte ^ 0x80
        q_low = _exact_float(_byte(base + 2 + i, mask) ^ 0x80, 128.0)
        q_high = _exact_float(_byte(base + 18 + i, mask) ^ 0x80, 128.0)
        w_low, w_high = _flat(d * q_low, d * q_high, BN)
        return w_low, w_high, index, index + 16
    low_at = 2 if QTYPE == 2 else (4 if QTYPE == 3 else (6 if QTYPE == 6 else 8))
    qs = _byte(base + low_at + i, mask)
    low, high = qs & 0xF, qs >> 4
    if QTYPE == 6 or QTYPE == 7:  # Q5: the fifth bit of value j is bit j of a 32-bit word
        bits_at = low_at - 4
        low += ((_byte(base + bits_at + i // 8, mask) >> (i % 8)) & 1) << 4
        high += ((_byte(base + bits_at + 2 + i // 8, mask) >> (i % 8)) & 1) << 4
    if QTYPE == 2 or QTYPE == 6:  # symmetric: w = d (q - 8) or d (q - 16)
        zero: tl.constexpr = 8.0 if QTYPE == 2 else 16.0
        w_low, w_high = d * _exact_float(low, zero), d * _exact_float(high, zero)
    else:  # with a min: w = d q + m
        m = _f16(base + 2, mask)
        w_low, w_high = d * _exact_float(low, 0.0) + m, d * _exact_float(high, 0.0) + m
    w_low, w_high = _flat(w_low, w_high, BN)
    return w_low, w_high, index, index + 16


@triton.jit
def _scale_min(base, sub, mask):
    """ggml's get_scale_min_k4: the 6-bit scale and min of sub-block `sub` (0..7)."""
    b_sub = _byte(base + 4 + sub, mask)
    b_sub4 = _byte(base + 8 + sub, mask)  # byte sub + 4
    b_below = _byte(base + 4 + tl.maximum(sub - 4, 0), mask)  # byte sub - 4
    low = sub < 4
    sc = tl.where(low, b_sub & 63, (b_sub4 & 0xF) | ((b_below >> 6) << 4))
    mn = tl.where(low, b_sub4 & 63, (b_sub4 >> 4) | ((b_sub >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _k_tile(rows, step, n_mask, QTYPE: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr):
    """One 256-value block of each row (Q4_K, Q5_K, Q6_K): the values of the low and the
    high nibbles, and where they lie along K."""
    base = rows[:, :, None] + step * BB  # [BN, 1, 1]
    mask = n_mask[:, :, None]
    c = tl.arange(0, 4)[None, :, None]  # [1, 4, 1]
    i = tl.arange(0, 32)[None, None, :]  # [1, 1, 32]
    v = tl.arange(0, HALF)  # the columns of each half: chunk c = v // 32, byte v % 32
    if QTYPE == 14:  # Q6_K: c = 2 half + (0 | 1), the 32 low-nibble bytes at 32c
        half, part = c // 2, c % 2
        ql = _byte(base + c * 32 + i, mask)  # [BN, 4, 32]
        qh = _byte(base + 128 + half * 32 + i, mask)
        # quarter r = part (low nibbles) or part + 2 (high), its two bits at 2r of qh
        low = _exact_float((ql & 0xF) | (((qh >> (2 * part)) & 3) << 4), 32.0)
        high = _exact_float((ql >> 4) | (((qh >> (2 * part + 4)) & 3) << 4), 32.0)
        j = tl.arange(0, 2)[None, None, :, None]  # sub-blocks of 16: scale 8 half + 2r + j
        sc_at = base[:, :, :, None] + 192 + half[:, :, :, None] * 8 + 2 * part[:, :, :, None] + j
        m4 = mask[:, :, :, None]
        sc_low = tl.load(sc_at, mask=m4, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        sc_high = tl.load(sc_at + 4, mask=m4, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        d = _f16(base + 208, mask)[:, :, :, None]
        q_low = tl.reshape(low, (BN, 4, 2, 16))
        q_high = tl.reshape(high, (BN, 4, 2, 16))
        w_low = tl.reshape(d * sc_low * q_low, (BN, 4, 32))
        w_high = tl.reshape(d * sc_high * q_high, (BN, 4, 32))
        # low nibbles: quarter r = c % 2 of half c // 2; high nibbles: quarter r + 2
        index = (v // 64) * 128 + ((v // 32) % 2) * 32 + v % 32
        w_low, w_high = _flat(w_low, w_high, BN)
        return w_low, w_high, index, index + 64
    # Q4_K, Q5_K: chunk c of 32 bytes holds sub-block 2c (low nibbles) and 2c + 1 (high)
    qs_at = 16 if QTYPE == 12 else 48
    qs = _byte(base + qs_at + c * 32 + i, mask)  # [BN, 4, 32]
    low, high = qs & 0xF, qs >> 4
    if QTYPE == 13:  # the fifth bit of value i of sub-block s: bit s of high byte i
        qh = _byte(base + 16 + i, mask)  # [BN, 1, 32]
        low += ((qh >> (2 * c)) & 1) << 4
        high += ((qh >> (2 * c + 1)) & 1) << 4
    sc_low, m_low = _scale_min(base, 2 * c, mask)  # [BN, 4, 1]
    sc_high, m_high = _scale_min(base, 2 * c + 1, mask)
    d, dmin = _f16(base, mask), _f16(base + 2, mask)
    w_low = (d * sc_low) * _exact_float(low, 0.0) - dmin * m_low
    w_high = (d * sc_high) * _exact_float(high, 0.0) - dmin * m_high
    index = (v // 32) * 64 + v % 32  # sub-block 2c; the high nibbles: 2c + 1
    w_low, w_high = _flat(w_low, w_high, BN)
    return w_low, w_high, index, index + 32


@triton.jit
def _tile(
    rows,
    step,
    k,
    n_mask,
    QTYPE: tl.constexpr,
    BB: tl.constexpr,
    BN: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Step `step` (STEP values along K) of rows [BN, 1] (pointers to each row's first
    byte) -> the weights in two halves [BN, HALF] float32 (the values of low and high
    nibbles, as the bytes hold them) and the index along K (within the step) of each
    column of each half: runs of 16 or 32 consecutive values."""
    if QTYPE >= 12:
        return _k_tile(rows, step, n_mask, QTYPE, BB, BN)
    return _legacy_tile(rows, step, k, n_mask, QTYPE, BB, BN, EVEN_K)


@triton.jit
def _columns(x_rows, offs_m, m, k, step, index, EVEN_K: tl.constexpr):
    """x [BM, HALF]: the columns `index` of step `step`."""
    g = step * STEP + index[None, :]  # [1, HALF]: the columns' places along K
    return tl.load(x_rows + g, mask=(offs_m[:, None] < m) & (EVEN_K or g < k), other=0.0)


@triton.jit(do_not_specialize=["m"])
def _gguf_linear_kernel(
    x_ptr,  # [M, K]
    raw_ptr,  # [N, row_bytes] uint8
    bias_ptr,  # [N] with HAS_BIAS
    out_ptr,  # [M, N]
    m,
    n,
    k,
    stride_x_row,
    stride_raw_row,
    stride_out_row,
    QTYPE: tl.constexpr,
    BB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,  # K a multiple of STEP: no mask along K
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n[:, None] < n
    rows = raw_ptr + offs_n[:, None].to(tl.int64) * stride_raw_row  # [BN, 1]
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x_row  # [BM, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Without tl.dot (one row): products summed per column, and across columns once at the end.
    wide = tl.zeros((BLOCK_N, HALF), dtype=tl.float32)
    for step in range(0, tl.cdiv(k, STEP)):
        w_low, w_high, index_low, index_high = _tile(
            rows, step, k, n_mask, QTYPE, BB, BLOCK_N, EVEN_K
        )
        x_low = _columns(x_rows, offs_m, m, k, step, index_low, EVEN_K)  # [BM, HALF]
        x_high = _columns(x_rows, offs_m, m, k, step, index_high, EVEN_K)
        if USE_DOT:
            acc += tl.dot(x_low, tl.trans(w_low.to(x_low.dtype)), input_precision=DOT_PRECISION)
            acc += tl.dot(x_high, tl.trans(w_high.to(x_high.dtype)), input_precision=DOT_PRECISION)
        else:
            wide += w_low * x_low.to(tl.float32) + w_high * x_high.to(tl.float32)
    if not USE_DOT:
        acc = tl.sum(wide, axis=1)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_out_row + offs_n[None, :]
    mask = (offs_m[:, None] < m) & (offs_n[None, :] < n)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(
    raw_ptr,
    out_ptr,  # [N, K]
    n,
    k,
    stride_raw_row,
    stride_out_row,
    QTYPE: tl.constexpr,
    BB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    step = tl.program_id(1)
    n_mask = offs_n[:, None] < n
    rows = raw_ptr + offs_n[:, None].to(tl.int64) * stride_raw_row
    w_low, w_high, index_low, index_high = _tile(rows, step, k, n_mask, QTYPE, BB, BLOCK_N, EVEN_K)
    out = out_ptr + offs_n[:, None].to(tl.int64) * stride_out_row + step * STEP
    g_low, g_high = index_low[None, :], index_high[None, :]
    tl.store(
        out + g_low, w_low.to(out_ptr.dtype.element_ty), mask=n_mask & (step * STEP + g_low < k)
    )
    tl.store(
        out + g_high, w_high.to(out_ptr.dtype.element_ty), mask=n_mask & (step * STEP + g_high < k)
    )


def dequantize_gguf(raw: torch.Tensor, qtype: str, k: int, dtype: torch.dtype) -> torch.Tensor:
    """`kernels.gguf.dequantize_gguf_reference`, written in `dtype`: [N, K]."""
    t = _check_weight(raw, qtype, k)
    n = raw.shape[0]
    out = torch.empty((n, k), dtype=dtype, device=raw.device)
    block_n = 16
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, STEP_VALUES))
    _dequantize_kernel[grid](
        raw, out, n, k, raw.stride(0), out.stride(0),
        QTYPE=t.type_id, BB=t.block_bytes, BLOCK_N=block_n, EVEN_K=k % STEP_VALUES == 0,
    )  # fmt: skip
    return out


def gguf_linear(
    x: torch.Tensor,  # [M, K]
    raw: torch.Tensor,  # [N, row_bytes] uint8
    qtype: str,
    bias: torch.Tensor | None = None,  # [N]
    *,
    tiles: GgufTiles | None = None,  # None: default_tiles(M)
) -> torch.Tensor:  # [M, N], x.dtype
    """`kernels.gguf.gguf_linear_reference`: up to DEQUANTIZE_ABOVE_ROWS rows one launch that
    reads the blocks; past that the weight dequantized, then cuBLAS (unless `tiles` asks for
    the launch, as the sweep does)."""
    if x.dtype not in DTYPES or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be a row-major [M, K] float tensor, got {x.dtype} {x.shape}")
    if x.device != raw.device:
        raise ValueError(f"x is on {x.device}, the GGUF weight on {raw.device}")
    m, k = x.shape
    t = _check_weight(raw, qtype, k)
    n = raw.shape[0]
    if m > DEQUANTIZE_ABOVE_ROWS and tiles is None:
        weight = dequantize_gguf(raw, qtype, k, x.dtype)
        return torch.nn.functional.linear(x, weight, bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    tiles = tiles or default_tiles(m)
    if not tiles.use_dot and tiles.block_m != 1:
        raise ValueError(f"{tiles}: without tl.dot a program takes one row")
    if tiles.use_dot and min(tiles.block_m, tiles.block_n) < DOT_MIN:
        raise ValueError(f"{tiles}: tl.dot needs every tile dimension >= {DOT_MIN}")
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _gguf_linear_kernel[grid](
        x, raw, bias if bias is not None else x, out, m, n, k,
        x.stride(0), raw.stride(0), out.stride(0),
        QTYPE=t.type_id, BB=t.block_bytes,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, USE_DOT=tiles.use_dot,
        HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", EVEN_K=k % STEP_VALUES == 0,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out


def _check_weight(raw: torch.Tensor, qtype: str, k: int) -> GgufType:
    if qtype not in GGUF_TYPES:
        raise ValueError(f"no GGUF kernel for {qtype}; these run quantized: {list(GGUF_TYPES)}")
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(qtype, k):
        raise ValueError(f"{qtype} weight of K = {k} must be [N, {row_bytes(qtype, k)}] uint8")
    if raw.stride(1) != 1:
        raise ValueError("the GGUF weight's rows must be contiguous")
    return GGUF_TYPES[qtype]
