"""GGUF linear layers in Triton: llama.cpp's blocks dequantized where they are read.

Same layout as `kernels.gguf` (read its docstring): `raw [N, row_bytes] uint8`, the file's
bytes. A program owns [BLOCK_M, BLOCK_N] of the output and walks K in steps of STEP values; for
each value it finds its block (value // block_elems) and reads the bytes that make it (a nibble
or a byte, the block's f16 scales, a K-quant's 6-bit sub-block scales) with byte loads, so any
block size and alignment works and the weight is read once per program. Up to 4 rows the
step is a multiply-add and a reduction (decode); up to 64 rows a tl.dot of 16-row tiles; past
that the weight is dequantized to the activation's dtype by the same helper and multiplied by
cuBLAS. The dequantized weight is float32 in registers, rounded to the activation's dtype only
for tl.dot, so it is at least as close to the exact product as the reference.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.gguf import GGUF_TYPES, GgufType, row_bytes

DOT_MIN = 16
FMA_MAX_ROWS = 4
DEQUANTIZE_ABOVE_ROWS = 64
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = (
    GGUF_TYPES[name].type_id
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
)


@dataclasses.dataclass(frozen=True)
class GgufTiles:
    block_m: int
    block_n: int
    step: int  # K values per step (a power of two; a block may span several steps)
    num_warps: int
    use_dot: bool


def default_tiles(m: int) -> GgufTiles:
    if m <= FMA_MAX_ROWS:
        rows = triton.next_power_of_2(m)
        return GgufTiles(rows, 16, 256 // rows, num_warps=4, use_dot=False)
    return GgufTiles(16, 64, 64, num_warps=4, use_dot=True)


@triton.jit
def _byte(ptrs, mask):
    return tl.load(ptrs, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptrs, mask):  # the little-endian f16 at ptrs, as float32
    bits = _byte(ptrs, mask) | (_byte(ptrs + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(qs_ptrs, e, HALF: tl.constexpr, mask):
    """Value e of a run of 2 * HALF values whose bytes hold e (low half) and e + HALF."""
    return (_byte(qs_ptrs + e % HALF, mask) >> ((e // HALF) * 4)) & 0xF


@triton.jit
def _dequantize(rows, g, mask, QTYPE: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr):
    """Values g [1, S] (indices along K) of rows [BN, 1] (pointers to each row's first
    byte) -> [BN, S] float32; masked values are 0."""
    block = rows + (g // QK) * BB  # [BN, S] pointers to each value's block
    e = g % QK  # the value's index inside its block
    if QTYPE == 8:  # Q8_0
        q = tl.load(block + 2 + e, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = _f16(block, mask) * q.to(tl.float32)
    elif QTYPE == 2:  # Q4_0
        w = _f16(block, mask) * (_nibble(block + 2, e, 16, mask) - 8).to(tl.float32)
    elif QTYPE == 3:  # Q4_1
        q = _nibble(block + 4, e, 16, mask).to(tl.float32)
        w = _f16(block, mask) * q + _f16(block + 2, mask)
    elif QTYPE == 6 or QTYPE == 7:  # Q5_0, Q5_1: bit e of the high-bits word
        low_at = 6 if QTYPE == 6 else 8
        high = (_byte(block + low_at - 4 + e // 8, mask) >> (e % 8)) & 1
        q = (_nibble(block + low_at, e, 16, mask) | (high << 4)).to(tl.float32)
        if QTYPE == 6:
            w = _f16(block, mask) * (q - 16.0)
        else:
            w = _f16(block, mask) * q + _f16(block + 2, mask)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K
        sub = e // 32  # sub-block: chunk e // 64, low or high halves of its 32 bytes
        qs_at = 16 if QTYPE == 12 else 48
        q = (_byte(block + qs_at + (e // 64) * 32 + e % 32, mask) >> ((sub % 2) * 4)) & 0xF
        if QTYPE == 13:
            q += ((_byte(block + 16 + e % 32, mask) >> sub) & 1) << 4
        # ggml's get_scale_min_k4: 6-bit scale and min of each sub-block in 12 bytes.
        b_sub = _byte(block + 4 + sub, mask)
        b_sub4 = _byte(block + 8 + sub, mask)
        b_below = _byte(block + 4 + tl.maximum(sub - 4, 0), mask)
        low = sub < 4
        sc = tl.where(low, b_sub & 63, (b_sub4 & 0xF) | ((b_below >> 6) << 4))
        mn = tl.where(low, b_sub4 & 63, (b_sub4 >> 4) | ((b_sub >> 6) << 4))
        d, dmin = _f16(block, mask), _f16(block + 2, mask)
        w = (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * mn.to(tl.float32)
    else:  # Q6_K: halves of 128; in each, quarters r of 32 from low/high nibbles and 2 bits
        half, r, i = e // 128, (e % 128) // 32, e % 32
        low = (_byte(block + half * 64 + (r % 2) * 32 + i, mask) >> ((r // 2) * 4)) & 0xF
        high = (_byte(block + 128 + half * 32 + i, mask) >> (2 * r)) & 3
        q = (low | (high << 4)) - 32
        sc = tl.load(block + 192 + half * 8 + 2 * r + i // 16, mask=mask, other=0)
        sc = sc.to(tl.int8, bitcast=True).to(tl.float32)
        w = (_f16(block + 208, mask) * sc) * q.to(tl.float32)
    return w


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
    QK: tl.constexpr,
    BB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STEP: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = raw_ptr + offs_n[:, None].to(tl.int64) * stride_raw_row  # [BN, 1]
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x_row  # [BM, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, STEP):
        g = start + tl.arange(0, STEP)[None, :]  # [1, S]
        w = _dequantize(rows, g, (offs_n[:, None] < n) & (g < k), QTYPE, QK, BB)  # [BN, S]
        x = tl.load(x_rows + g, mask=(offs_m[:, None] < m) & (g < k), other=0.0)  # [BM, S]
        if USE_DOT:
            wt = tl.trans(w.to(x.dtype))
            acc += tl.dot(x, wt, input_precision=DOT_PRECISION)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
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
    QK: tl.constexpr,
    BB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STEP: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1) * STEP + tl.arange(0, STEP)[None, :]
    mask = (offs_n[:, None] < n) & (g < k)
    rows = raw_ptr + offs_n[:, None].to(tl.int64) * stride_raw_row
    w = _dequantize(rows, g, mask, QTYPE, QK, BB)
    out = out_ptr + offs_n[:, None].to(tl.int64) * stride_out_row + g
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_gguf(raw: torch.Tensor, qtype: str, k: int, dtype: torch.dtype) -> torch.Tensor:
    """`kernels.gguf.dequantize_gguf_reference`, written in `dtype`: [N, K]."""
    t = _check_weight(raw, qtype, k)
    n = raw.shape[0]
    out = torch.empty((n, k), dtype=dtype, device=raw.device)
    block_n, step = 16, 256
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, step))
    _dequantize_kernel[grid](
        raw, out, n, k, raw.stride(0), out.stride(0),
        QTYPE=t.type_id, QK=t.block_elems, BB=t.block_bytes, BLOCK_N=block_n, STEP=step,
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
    reads the blocks; past that the weight dequantized, then cuBLAS."""
    if x.dtype not in DTYPES or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be a row-major [M, K] float tensor, got {x.dtype} {x.shape}")
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
    if tiles.use_dot and min(tiles.block_m, tiles.block_n, tiles.step) < DOT_MIN:
        raise ValueError(f"{tiles}: tl.dot needs every tile dimension >= {DOT_MIN}")
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _gguf_linear_kernel[grid](
        x, raw, bias if bias is not None else x, out, m, n, k,
        x.stride(0), raw.stride(0), out.stride(0),
        QTYPE=t.type_id, QK=t.block_elems, BB=t.block_bytes,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, STEP=tiles.step, USE_DOT=tiles.use_dot,
        HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
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
