"""An int4 weight-only GEMM for many rows (prefill chunks, decode batches past 64 rows): each
program makes its weight tile whole in registers from the packed words and feeds one tl.dot a
step, so the weight is read packed, once a tile of rows, where the dequantize pass + cuBLAS
(kernels/triton_int4_dequant.py) writes a bf16 copy of it and reads that back.

    out[M, N] = x[M, K] @ w[N, K]^T      programs: (row tile, weight-row tile), row tiles
                                          fastest, so a weight tile comes from HBM once

The packed layout is kernels.int4's: word c of a 32-column chunk holds nibble i = 2p + h at the
chunk's column 8p + 2c + h. A step's words [BN, BK/8] unpacked nibble by nibble give the
columns in the order (chunk, c, p, h); one permute of the tile puts them in column order
(chunk, p, c, h), so x's tile loads as it lies. A step is BLOCK_K = 128 columns inside one
group (groups a multiple of 128, no act-order: `applies`): one scale and zero point a weight
row a step. The weight is made whole and rounded to x's dtype before the dot, as the reference
does (kernels.int4.int4_linear_reference), and the dot sums in float32.

Not the engine's default yet (kernels/triton_int4.py keeps the pass + cuBLAS past 64 rows):
`python -m sweeps.int4_sweep --m 96 128 256 512` times its tiles against that on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.int4 import CHUNK, PACK, Int4Tiles
from kernels.triton_int4_dequant import operands

STEP = 128  # columns a step: one group of 128, or a part of a larger one
# A compiled kernel reads only constexpr globals (the interpreter reads any).
_CHUNK = tl.constexpr(CHUNK)
DTYPES = (torch.bfloat16, torch.float16)


def applies(dtype: torch.dtype, k: int, group_size: int, act_order: bool) -> bool:
    """Whether the GEMM runs: a 16-bit x, K and the groups in whole steps, no act-order."""
    return dtype in DTYPES and k % STEP == 0 and group_size % STEP == 0 and not act_order


@triton.jit(do_not_specialize=["m"])
def _int4_gemm_kernel(
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
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # STEP
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRETED: tl.constexpr,  # TRITON_INTERPRET: tl.dot on float32 tiles (see triton_linear)
):
    num_row_tiles = tl.cdiv(m, BLOCK_M)
    rows = (tl.program_id(0) % num_row_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = (tl.program_id(0) // num_row_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ks = tl.arange(0, BLOCK_K)
    words = tl.arange(0, BLOCK_K // 8)  # [W]
    shifts = 4 * tl.arange(0, 8)  # nibble i at bits 4i
    row_valid = rows < m
    col_valid = cols < n
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x_row + ks[None, :]  # [BM, BK]
    w_ptrs = qweight_ptr + cols[:, None].to(tl.int64) * stride_qweight_row + words[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, k, BLOCK_K):  # K % BLOCK_K == 0 (`applies`)
        x = tl.load(x_ptrs + k_start, mask=row_valid[:, None], other=0.0)  # [BM, BK]
        packed = tl.load(w_ptrs + k_start // 8, mask=col_valid[:, None], other=0)  # [BN, W]
        q = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # [BN, W, 8]: (chunk, c, i)
        q = tl.reshape(q, [BLOCK_N, BLOCK_K // _CHUNK, 4, 4, 2])  # (chunk, c, p, h)
        q = tl.reshape(tl.permute(q, (0, 1, 3, 2, 4)), [BLOCK_N, BLOCK_K])  # column order
        group = k_start // GROUP_SIZE
        scale = tl.load(scales_ptr + cols * stride_scales_row + group, mask=col_valid, other=0.0)
        float_zero = tl.full([BLOCK_N], 8.0 + 8388608.0, tl.float32)  # 2**23 + z
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + cols * stride_zeros_row + group, mask=col_valid, other=0)
            float_zero = zero.to(tl.float32) + 8388608.0
        # 2**23 + q less 2**23 + z: q - z with one subtraction (no integer-to-float convert)
        qz = (q | 0x4B000000).to(tl.float32, bitcast=True) - float_zero[:, None]
        w = (qz * scale.to(tl.float32)[:, None]).to(x_ptr.dtype.element_ty)  # [BN, BK]
        if INTERPRETED:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out_row + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid)


def launch_gemm(
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
    """`tiles` ("gemm"): block_m x block_n programs over steps of STEP columns."""
    k = x.shape[1]
    if not applies(x.dtype, k, group_size, g_idx is not None) or tiles.block_k != STEP:
        raise ValueError(
            f"{tiles}: the int4 GEMM needs a bf16 or fp16 x, K and the group size multiples of"
            f" {STEP}, no g_idx, and block_k {STEP}"
        )
    if min(tiles.block_m, tiles.block_n) < 16:
        raise ValueError(f"{tiles}: tl.dot needs tiles of at least 16 rows and columns")
    m, n = x.shape[0], qweight.shape[0]
    assert STEP % CHUNK == 0 and STEP % PACK == 0
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    _int4_gemm_kernel[grid](
        *operands(x, qweight, scales, zeros, bias, out),
        m,
        GROUP_SIZE=group_size,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=STEP,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None,
        INTERPRETED=not x.is_cuda,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
