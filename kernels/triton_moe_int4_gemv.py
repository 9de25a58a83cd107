"""One token's (token, expert) pairs against int4 experts (kernels/triton_moe_int4.py picks
these kernels by `uses_int4_gemv`): two GEMVs with no sorting, as
kernels/triton_moe_gemv.py does for float experts, with the multiply-adds of
kernels/triton_int4.py's rows kernel (CUDA cores, one FMA a nibble: a word's sum is
16 sum x v - (16 + z) sum x with v = 1 + q/16). MXFP4 experts (gpt-oss's, `Int4Stack.e2m1`)
read each code as its e2m1 value times its group's scale instead (kernels/triton_e2m1.py).

`_int4_pair_gate_up_kernel`: a program per pair and BLOCK_N columns of the expert's gate and
up rows, SiLU-and-mul fused (gpt-oss's biases and clamped SwiGLU where given).
`_int4_token_down_kernel`: a program per token and BLOCK_N output columns walks its k experts'
down rows side by side, each scaled by its routing weight, so the sum needs no launch of its
own. At one token of Qwen3-30B-A3B (H200) a layer takes 40.6 us here against 50.8 in the
grouped GEMMs, whose blocks of 16 pairs hold one; from two tokens on the grouped GEMMs are
faster (56.5 against 60.6 us). Both stay far above the bytes' floor (4.7 us) and above bf16's
GEMVs (37.5 us): they are not bound by memory, and what bounds them is not profiled yet
(docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.int4 import Int4Stack
from kernels.moe import ClampedSwiglu, ExpertBiases
from kernels.triton_e2m1 import e2m1_pairs, e2m1_value
from kernels.triton_int4 import one_plus_q16, x_pair
from kernels.triton_moe_gemv import epilogue, expert_activation


@dataclasses.dataclass(frozen=True)
class Int4GemvTiles:
    """Weight rows a program, words of each a K step (8 columns a word; a power of two, the
    last step masked where it runs past K), warps."""

    gate_up_n: int = 4
    gate_up_words: int = 256
    down_n: int = 4
    down_words: int = 128
    num_warps: int = 2


# sweeps/moe_int4_sweep.py's pick at one token (H200, 2026-12-04): 40.6 us a layer against
# 53.2 for 8 x 128 words over 4 warps (gate/up) and 8 x 32 (down).
INT4_GEMV_TILES = Int4GemvTiles()
# MXFP4's (sweeps/mxfp4_gemv_sweep.py, 54 candidates, one gpt-oss-20b layer, H100,
# 2026-12-06): 78.4 / 221.3 / 411.6 us at 1 / 4 / 8 tokens, the best at each 77.5 / 221.3 /
# 403.1; the first pick (8 x 128 words gate/up, 8 x 64 down) 82.1 / 239.1 / 450.7.
MXFP4_GEMV_MAX_PAIRS = 32  # uses_int4_gemv
MXFP4_GEMV_TILES = Int4GemvTiles(gate_up_n=8, gate_up_words=64, down_n=8, down_words=64,
                                 num_warps=4)  # fmt: skip


def uses_int4_gemv(num_pairs: int, num_experts: int, e2m1: bool = False) -> bool:
    """int4: one token's pairs of top 8 among 128 experts, at most a sixteenth of the experts
    chosen. MXFP4 (whose grouped GEMMs make each weight tile code by code): up to 32 pairs,
    and no more than the experts. One layer of gpt-oss-20b's (32 experts, top 4, H100,
    2026-12-06, MXFP4_GEMV_TILES) took 78, 221 and 412 us here at 4, 16 and 32 pairs against
    268, 388 and 457 in the grouped GEMMs (their best tiles: 207, 321, 446); at 128 pairs the
    GEMVs took 1,495 against 573. The GEMVs' time grows with the pairs, the grouped GEMMs'
    with the experts chosen: a cap on pairs, not a share of the experts, keeps gpt-oss-120b's
    128 experts from taking them past 8 tokens."""
    if e2m1:
        return num_pairs <= min(MXFP4_GEMV_MAX_PAIRS, num_experts)
    return num_pairs * 16 <= num_experts


@triton.jit
def _rows_step(w_rows, s_rows, z_rows, cols_ok, x_row, k_start, K, GROUP_SIZE: tl.constexpr,
               WORDS: tl.constexpr, HAS_ZEROS: tl.constexpr, X_PAIRS: tl.constexpr,
               E2M1: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    """[BN, WORDS]: each word's sum of x times its weights (q - z) * scale, over the K step
    of 8 * WORDS columns from k_start (those before K). w_rows [BN, 1] points at the weight
    rows, s_rows and z_rows [BN] at their scales and zero points. E2M1 (MXFP4 codes): each
    weight is the code's e2m1 value times the scale, for bf16 x on the GPU two at a time by
    kernels/triton_e2m1.py's e2m1_pairs, as the grouped GEMMs make them."""
    words = tl.arange(0, WORDS)
    valid = (k_start + 8 * words < K)[None, :]  # by whole chunks: K is a multiple of 32
    mask = cols_ok[:, None] & valid
    packed = tl.load(w_rows + (k_start // 8 + words)[None, :], mask=mask, other=0)
    groups = ((k_start + 8 * words) // GROUP_SIZE)[None, :]  # a word's 8 columns: one group
    scale = tl.load(s_rows[:, None] + groups, mask=mask, other=0.0)
    if E2M1:
        ptx: tl.constexpr = not INTERPRETED and x_row.dtype.element_ty == tl.bfloat16
        return _e2m1_step(packed, scale, x_row, k_start, words, valid, X_PAIRS, ptx)
    scale = scale.to(tl.float32)
    offset = tl.full(scale.shape, 16.0 + 8.0, tl.float32)  # 16 + z
    if HAS_ZEROS:
        offset = tl.load(z_rows[:, None] + groups, mask=mask, other=0).to(tl.float32) + 16.0
    step = tl.zeros(scale.shape, tl.float32)
    x_sum = tl.zeros([1, WORDS], tl.float32)
    for p in tl.static_range(4):
        lo, hi = x_pair(x_row, k_start, words, valid, p, X_PAIRS)
        x_sum += lo + hi
        step += one_plus_q16(packed, 2 * p) * lo
        step += one_plus_q16(packed, 2 * p + 1) * hi
    return (16.0 * step - offset * x_sum) * scale


@triton.jit
def _e2m1_step(packed, scale, x_row, k_start, words, valid, X_PAIRS: tl.constexpr,
               PTX: tl.constexpr):  # fmt: skip
    """_rows_step's sums for MXFP4 codes: scale [BN, W] in its stored dtype (bf16)."""
    step = tl.zeros(packed.shape, tl.float32)
    if PTX:
        pairs = e2m1_pairs(packed, scale)
        for p in tl.static_range(4):
            lo, hi = x_pair(x_row, k_start, words, valid, p, X_PAIRS)
            w_lo, w_hi = tl.split(pairs[p])
            step += w_lo.to(tl.float32) * lo + w_hi.to(tl.float32) * hi
        return step
    for p in tl.static_range(4):
        lo, hi = x_pair(x_row, k_start, words, valid, p, X_PAIRS)
        step += e2m1_value((packed >> (8 * p)) & 0xF) * lo
        step += e2m1_value((packed >> (8 * p + 4)) & 0xF) * hi
    return step * scale.to(tl.float32)


@triton.jit
def _int4_pair_gate_up_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [E, 2N, K/8] int32: gate rows, then up rows
    s_ptr,  # [E, 2N, G]
    z_ptr,  # [E, 2N, G] uint8 with HAS_ZEROS
    out_ptr,  # [pairs, N]
    ids_ptr,  # [pairs]: each pair's expert
    top_k,
    K,
    N,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    stride_out,
    bias_ptr,  # [E, 2N] with HAS_BIAS
    limit,  # with SWIGLU
    alpha,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    X_PAIRS: tl.constexpr,
    E2M1: tl.constexpr,
    INTERPRETED: tl.constexpr,  # TRITON_INTERPRET: no inline PTX
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
    x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_x
    w = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
    s = s_ptr + expert * stride_se + cols * stride_sn
    z = z_ptr + expert * stride_ze + cols * stride_zn
    gate = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    for k_start in range(0, K, 8 * WORDS):
        gate += _rows_step(w, s, z, cols_ok, x_row, k_start, K, GROUP_SIZE, WORDS, HAS_ZEROS,
                           X_PAIRS, E2M1, INTERPRETED)  # fmt: skip
        up += _rows_step(w + N * stride_wn, s + N * stride_sn, z + N * stride_zn, cols_ok, x_row,
                         k_start, K, GROUP_SIZE, WORDS, HAS_ZEROS, X_PAIRS, E2M1,
                         INTERPRETED)  # fmt: skip
    g, u = tl.sum(gate, axis=1), tl.sum(up, axis=1)
    out = expert_activation(g, u, bias_ptr + expert * 2 * N, cols, cols_ok, N, limit, alpha,
                            HAS_BIAS, SWIGLU)  # fmt: skip
    tl.store(out_ptr + pair * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=cols_ok)


@triton.jit
def _int4_token_down_kernel(
    h_ptr,  # [pairs, K]
    w_ptr,  # [E, N, K/8] int32
    s_ptr,  # [E, N, G]
    z_ptr,  # [E, N, G] uint8 with HAS_ZEROS
    out_ptr,  # [T, N]
    weights_ptr,  # [pairs] float32
    ids_ptr,  # [pairs]
    top_k,
    K,
    N,
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    stride_out,
    bias_ptr,  # [E, N] with HAS_BIAS
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    X_PAIRS: tl.constexpr,
    E2M1: tl.constexpr,
    INTERPRETED: tl.constexpr,  # TRITON_INTERPRET: no inline PTX
    HAS_BIAS: tl.constexpr,
):
    """The token's k experts' down rows side by side (K' = k * K): one loop, so loads stay
    in flight across experts. A pair of another rank's expert (-1) has a row of zeros and
    reads no weights."""
    token, tile = tl.program_id(0), tl.program_id(1)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < N
    steps = tl.cdiv(K, 8 * WORDS)
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    biased = tl.zeros((BLOCK_N,), dtype=tl.float32)  # each pair's bias times its weight
    for step in range(top_k * steps):
        pair = token * top_k + step // steps
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        here = cols < tl.where(expert >= 0, N, 0)  # the columns to read of its expert
        expert = tl.maximum(expert, 0)
        w = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
        s = s_ptr + expert * stride_se + cols * stride_sn
        z = z_ptr + expert * stride_ze + cols * stride_zn
        h_row = h_ptr + pair.to(tl.int64) * stride_h
        k_start = (step % steps) * 8 * WORDS
        part = _rows_step(w, s, z, here, h_row, k_start, K, GROUP_SIZE, WORDS, HAS_ZEROS,
                          X_PAIRS, E2M1, INTERPRETED)  # fmt: skip
        weight = tl.load(weights_ptr + pair)
        acc += part * weight
        if HAS_BIAS:  # once a pair, at its first step
            bias = tl.load(bias_ptr + expert * N + cols, mask=here, other=0.0).to(tl.float32)
            biased += tl.where(step % steps == 0, bias * weight, 0.0)
    out = tl.sum(acc, axis=1) + biased
    tl.store(out_ptr + token * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=cols_ok)


def moe_experts_int4_gemv(
    x: torch.Tensor,  # [T, H], contiguous
    gate_up: Int4Stack,
    down: Int4Stack,
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k]
    tiles: Int4GemvTiles | None = None,  # INT4_GEMV_TILES, or MXFP4_GEMV_TILES for MXFP4
    biases: ExpertBiases | None = None,  # gpt-oss's
    swiglu: ClampedSwiglu | None = None,  # gpt-oss's activation (None: silu(gate) * up)
) -> torch.Tensor:  # [T, H], x's dtype
    """moe_experts_int4 for few pairs: two launches, no sorting (the module's docstring)."""
    if gate_up.e2m1 != down.e2m1:
        raise ValueError("the int4 GEMVs take both projections' codes as int4 or as MXFP4")
    tiles = tiles or (MXFP4_GEMV_TILES if down.e2m1 else INT4_GEMV_TILES)
    num_tokens, top_k = ids.shape
    hidden, inter = down.qweight.shape[1], gate_up.qweight.shape[1] // 2
    ids = ids.contiguous()
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    x_pairs = {torch.bfloat16: 1, torch.float16: 2}.get(x.dtype, 0)  # 16-bit rows: int32 pairs
    codes = dict(E2M1=down.e2m1, INTERPRETED=not x.is_cuda, HAS_BIAS=biases is not None,
                 X_PAIRS=x_pairs, num_warps=tiles.num_warps)  # fmt: skip
    grid = (num_tokens * top_k, triton.cdiv(inter, tiles.gate_up_n))
    _int4_pair_gate_up_kernel[grid](
        x, *weight_args(gate_up)[:3], h, ids, top_k, hidden, inter, x.stride(0),
        *weight_args(gate_up)[3:], h.stride(0), *epilogue(biases, swiglu, x, "gate_up"),
        GROUP_SIZE=gate_up.group_size, BLOCK_N=tiles.gate_up_n, WORDS=tiles.gate_up_words,
        HAS_ZEROS=gate_up.zeros is not None, SWIGLU=swiglu is not None, **codes,
    )  # fmt: skip
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    grid = (num_tokens, triton.cdiv(hidden, tiles.down_n))
    _int4_token_down_kernel[grid](
        h, *weight_args(down)[:3], out, weights.float().contiguous(), ids, top_k, inter,
        hidden, h.stride(0), *weight_args(down)[3:], out.stride(0),
        epilogue(biases, swiglu, x, "down")[0], GROUP_SIZE=down.group_size,
        BLOCK_N=tiles.down_n, WORDS=tiles.down_words, HAS_ZEROS=down.zeros is not None, **codes,
    )  # fmt: skip
    return out


def weight_args(stack: Int4Stack) -> tuple[object, ...]:
    """The weight's pointers (the scales stand in for missing zero points), then its
    strides."""
    zeros = stack.zeros if stack.zeros is not None else stack.scales
    return (
        stack.qweight, stack.scales, zeros,
        stack.qweight.stride(0), stack.qweight.stride(1), stack.scales.stride(0),
        stack.scales.stride(1), zeros.stride(0), zeros.stride(1),
    )  # fmt: skip
