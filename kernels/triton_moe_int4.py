"""int4 experts (W4A16) in Triton: kernels/triton_moe.py's grouped GEMMs over the (token,
expert) pairs sorted by expert, with each weight tile made in registers from its packed words
(kernels/int4.py's layout, expert by expert). Same math as
`kernels.moe.moe_experts_int4_reference`.

A K step of 8 * WORDS columns loads [BLOCK_N, WORDS] words; as in kernels/triton_int4.py's dot
kernel, nibbles 2p and 2p + 1 of each word side by side hold the chunk's columns 8p .. 8p + 7,
so tl.dot takes four weight tiles [BLOCK_N, 2 * WORDS] against x^T read in runs of 8 columns.
Two ways to make the tiles (`FAST`):

- a step inside one group, 16-bit x (a checkpoint's groups of 128, or one a row): q - z exact
  in x's dtype (on the GPU by kernels/triton_int4.py's inline PTX), the group's scale times
  the step's float32 sum;
- otherwise (groups of 32 or 64, float32 x): each weight dequantized by its own group's scale
  and zero point and rounded to x's dtype, as the reference does.

MXFP4 experts (gpt-oss's; `Int4Stack.e2m1`) in bf16 on the GPU: each pair of codes becomes
its two bf16 values times their group's power-of-two scale in seven instructions of PTX
(`e2m1_pairs`, kernels/int4_pairs.py), exact. Elsewhere they take the second way: each code
read as its e2m1 value (`e2m1_value`) times the scale, exact in bf16 and float32 (float16
rounds scales below 2 ** -14 into its subnormals, as the reference does). gpt-oss's
expert biases and clamped SwiGLU are fused into the epilogues, as in kernels/triton_moe.py.

Every block of pairs reads its expert's words once, so a decode step reads only the chosen
experts' weights, a quarter of bf16's bytes. Few pairs (`uses_int4_gemv`) take the GEMVs of
kernels/triton_moe_int4_gemv.py instead, MXFP4 and gpt-oss's epilogues included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.int4 import CHUNK, PACK, Int4Stack
from kernels.moe import ClampedSwiglu, ExpertBiases, own_pairs
from kernels.triton_e2m1 import e2m1_pairs, e2m1_value
from kernels.triton_int4 import q_minus_z_pairs
from kernels.triton_moe import block_pairs, block_tile, exact_dot, sum_chosen
from kernels.triton_moe_align import align
from kernels.triton_moe_gemv import epilogue, expert_activation
from kernels.triton_moe_int4_gemv import moe_experts_int4_gemv, uses_int4_gemv, weight_args
from kernels.triton_moe_tiles import GemmTiles, GroupedTiles, grouped_tiles
from kernels.triton_stages import launch_fitting

_CHUNK = tl.constexpr(CHUNK)
# K steps of up to 128 columns (one group of a checkpoint's usual 128), 64 weight rows.
INT4_TILES = GemmTiles(n=64, k=128, num_warps=4, num_stages=3)
GPU_MIN_STEP = 64  # tl.dot on the GPU: tiles of 2 * WORDS = 16 columns at least


def int4_grouped_tiles(num_pairs: int) -> GroupedTiles:
    """The bf16 experts' block of pairs for the count (kernels/triton_moe_tiles.py), and
    INT4_TILES for both GEMMs."""
    return GroupedTiles(grouped_tiles(num_pairs).block_m, INT4_TILES, INT4_TILES)


@triton.jit
def _dot(weight, xt, acc, INTERPRETED: tl.constexpr):
    if INTERPRETED:  # float32 dots: the interpreter's 16-bit ones round differently
        return exact_dot(weight.to(tl.float32), xt.to(tl.float32), acc)
    return exact_dot(weight, xt, acc)


@triton.jit
def _step(acc, x_rows, rows_ok, k_step, K, w_rows, s_rows, z_rows, cols_ok, group_size,
          WORDS: tl.constexpr, HAS_ZEROS: tl.constexpr, FAST: tl.constexpr,
          E2M1: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    """acc [BN, BM] plus W x^T over the K step of 8 * WORDS columns from k_step, those before
    K (the last step may run past it by whole chunks; never FAST's, which lies in one
    group). x_rows [1, BM] and w_rows [BN, 1] point at the rows, s_rows and z_rows [BN] at the
    rows' scales and zero points. E2M1 (MXFP4 codes): on the GPU in bf16 each code pair times
    its scale by e2m1_pairs, elsewhere the second way (FAST off)."""
    words = tl.arange(0, WORDS)
    pair_k = tl.arange(0, 2 * WORDS)
    x_cols = (pair_k // 8) * _CHUNK + pair_k % 8  # tile p's columns, from k_step + 8p
    words_ok = (k_step // 8 + words < K // 8)[None, :]  # a word's 8 columns: one chunk's
    packed = tl.load(w_rows + (k_step // 8 + words)[None, :], mask=cols_ok[:, None] & words_ok,
                     other=0)  # fmt: skip
    dtype = x_rows.dtype.element_ty
    if E2M1 and not INTERPRETED and dtype == tl.bfloat16:  # e2m1_pairs' PTX
        # A word's 8 columns lie in one chunk of 32 columns: MXFP4's group, one scale.
        groups = ((k_step // 8 + words) // (_CHUNK // 8))[None, :]
        scale = tl.load(s_rows[:, None] + groups, mask=cols_ok[:, None] & words_ok, other=0.0)
        pairs = e2m1_pairs(packed, scale)
        for p in tl.static_range(4):
            ks = k_step + 8 * p + x_cols
            xt = tl.load(x_rows + ks[:, None], mask=rows_ok[None, :] & (ks < K)[:, None],
                         other=0.0)  # fmt: skip
            acc = _dot(tl.reshape(pairs[p], [acc.shape[0], 2 * WORDS]), xt, acc, INTERPRETED)
    elif FAST:
        group = k_step // group_size
        scale = tl.load(s_rows + group, mask=cols_ok, other=0.0).to(tl.float32)
        zero = tl.full(scale.shape, 8.0, tl.float32)
        if HAS_ZEROS:
            zero = tl.load(z_rows + group, mask=cols_ok, other=0).to(tl.float32)
        pairs = q_minus_z_pairs(packed, zero, dtype, INTERPRETED)
        step = tl.zeros(acc.shape, tl.float32)
        for p in tl.static_range(4):
            xt = tl.load(x_rows + (k_step + 8 * p + x_cols)[:, None], mask=rows_ok[None, :],
                         other=0.0)  # fmt: skip
            step = _dot(tl.reshape(pairs[p], [acc.shape[0], 2 * WORDS]), xt, step, INTERPRETED)
        acc += step * scale[:, None]
    else:
        for p in tl.static_range(4):
            ks = k_step + 8 * p + x_cols  # [2W]
            ks_ok = ks < K
            groups = (ks // group_size)[None, :]
            lo = (packed >> (8 * p)) & 0xF
            hi = (packed >> (8 * p + 4)) & 0xF
            q = tl.reshape(tl.join(lo, hi), [acc.shape[0], 2 * WORDS])
            mask = cols_ok[:, None] & ks_ok[None, :]
            scale = tl.load(s_rows[:, None] + groups, mask=mask, other=0.0).to(tl.float32)
            if E2M1:
                weight = (e2m1_value(q) * scale).to(dtype)
            else:
                zero = tl.full(q.shape, 8.0, tl.float32)
                if HAS_ZEROS:
                    zero = tl.load(z_rows[:, None] + groups, mask=mask, other=0).to(tl.float32)
                weight = ((q.to(tl.float32) - zero) * scale).to(dtype)
            xt = tl.load(x_rows + ks[:, None], mask=rows_ok[None, :] & ks_ok[:, None], other=0.0)
            acc = _dot(weight, xt, acc, INTERPRETED)
    return acc


# The pair count is not specialized, as in kernels/triton_moe.py (the warm-up meets every
# variant).
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _int4_gate_up_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [E, 2N, K/8] int32: gate rows, then up rows
    s_ptr,  # [E, 2N, G]
    z_ptr,  # [E, 2N, G] uint8 with HAS_ZEROS
    out_ptr,  # [pairs, N]
    sorted_ptr,  # [P] int32
    block_expert_ptr,  # [P / BLOCK_M] int32
    num_pairs,
    num_blocks,
    top_k,
    K,
    N,
    group_size,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    WORDS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    FAST: tl.constexpr,
    E2M1: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    block, tile = block_tile(num_blocks, N, BLOCK_N, GROUP_M)
    if tl.load(block_expert_ptr + block) < 0:
        return  # a block past the last group: no pairs
    pairs, rows_ok, expert, cols, cols_ok = block_pairs(
        sorted_ptr, block_expert_ptr, block, tile, num_pairs, N, BLOCK_M, BLOCK_N
    )
    x_rows = x_ptr + tl.where(rows_ok, pairs // top_k, 0)[None, :].to(tl.int64) * stride_x
    w = w_ptr + expert * stride_we + cols[:, None] * stride_wn
    s = s_ptr + expert * stride_se + cols * stride_sn
    z = z_ptr + expert * stride_ze + cols * stride_zn
    gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k_step in range(0, K, 8 * WORDS):
        gate = _step(gate, x_rows, rows_ok, k_step, K, w, s, z, cols_ok, group_size, WORDS,
                     HAS_ZEROS, FAST, E2M1, INTERPRETED)  # fmt: skip
        up = _step(up, x_rows, rows_ok, k_step, K, w + N * stride_wn, s + N * stride_sn,
                   z + N * stride_zn, cols_ok, group_size, WORDS, HAS_ZEROS, FAST, E2M1,
                   INTERPRETED)  # fmt: skip
    # The columns run down the tiles here: the biases load as [BLOCK_N, 1]
    out = expert_activation(gate, up, bias_ptr + expert * 2 * N, cols[:, None],
                            cols_ok[:, None], N, limit, alpha, HAS_BIAS, SWIGLU)  # fmt: skip
    out_ptrs = out_ptr + pairs[None, :].to(tl.int64) * stride_out + cols[:, None]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=rows_ok[None, :] & cols_ok[:, None])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _int4_down_kernel(
    h_ptr,  # [pairs, K]
    w_ptr,  # [E, N, K/8] int32
    s_ptr,  # [E, N, G]
    z_ptr,  # [E, N, G] uint8 with HAS_ZEROS
    out_ptr,  # [pairs, N]
    weights_ptr,  # [pairs] float32: each pair's routing weight
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    num_blocks,
    K,
    N,
    group_size,
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    stride_out,
    bias_ptr,  # [E, N] with HAS_BIAS
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    WORDS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    FAST: tl.constexpr,
    E2M1: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    block, tile = block_tile(num_blocks, N, BLOCK_N, GROUP_M)
    if tl.load(block_expert_ptr + block) < 0:
        return
    pairs, rows_ok, expert, cols, cols_ok = block_pairs(
        sorted_ptr, block_expert_ptr, block, tile, num_pairs, N, BLOCK_M, BLOCK_N
    )
    rows = tl.where(rows_ok, pairs, 0)
    h_rows = h_ptr + rows[None, :].to(tl.int64) * stride_h
    w = w_ptr + expert * stride_we + cols[:, None] * stride_wn
    s = s_ptr + expert * stride_se + cols * stride_sn
    z = z_ptr + expert * stride_ze + cols * stride_zn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k_step in range(0, K, 8 * WORDS):
        acc = _step(acc, h_rows, rows_ok, k_step, K, w, s, z, cols_ok, group_size, WORDS,
                    HAS_ZEROS, FAST, E2M1, INTERPRETED)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * N + cols, mask=cols_ok, other=0.0)[:, None]
    acc *= tl.load(weights_ptr + rows, mask=rows_ok, other=0.0)[None, :]
    out_ptrs = out_ptr + rows[None, :].to(tl.int64) * stride_out + cols[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rows_ok[None, :] & cols_ok[:, None])


def moe_experts_int4(
    x: torch.Tensor,  # [T, H]
    gate_up: Int4Stack,  # [E, 2 I, H / 8]
    down: Int4Stack,  # [E, H, I / 8]
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k]
    biases: ExpertBiases | None = None,  # gpt-oss's
    swiglu: ClampedSwiglu | None = None,  # gpt-oss's activation (None: silu(gate) * up)
    all_experts: int | None = None,  # with expert parallelism, every rank's (None: down's)
) -> torch.Tensor:  # [T, H], x's dtype
    """moe_experts_int4_reference: few pairs by GEMVs (kernels/triton_moe_int4_gemv.py), the
    rest by the grouped GEMMs. With expert parallelism the choice counts about this rank's
    share of the pairs (the others' choices are -1 here, which the GEMVs skip)."""
    x = x.contiguous()
    hidden, inter = down.qweight.shape[1], gate_up.qweight.shape[1] // 2
    _check(x, gate_up, hidden)
    _check(x.new_empty(0, inter), down, inter)
    experts = down.qweight.shape[0]
    pairs = own_pairs(ids.numel(), experts, all_experts)
    if uses_int4_gemv(pairs, experts, e2m1=down.e2m1):
        return moe_experts_int4_gemv(x, gate_up, down, weights, ids, biases=biases, swiglu=swiglu)
    return moe_experts_int4_grouped(x, gate_up, down, weights, ids, biases=biases, swiglu=swiglu)


def moe_experts_int4_grouped(
    x: torch.Tensor,
    gate_up: Int4Stack,
    down: Int4Stack,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tiles: GroupedTiles | None = None,
    biases: ExpertBiases | None = None,
    swiglu: ClampedSwiglu | None = None,
) -> torch.Tensor:
    """moe_experts_int4 over the pairs sorted by expert (the module's docstring): [pairs, I]
    SiLU-and-mul rows in x's dtype, then each pair's down row times its routing weight, and
    each token's k rows summed in float32. x: contiguous, checked by moe_experts_int4.
    `tiles`: int4_grouped_tiles by the pair count unless given."""
    num_tokens, top_k = ids.shape
    hidden, inter = down.qweight.shape[1], gate_up.qweight.shape[1] // 2
    num_pairs = num_tokens * top_k
    tiles = tiles or int4_grouped_tiles(num_pairs)
    block_m = tiles.block_m
    sorted_pairs, block_experts = align(ids, down.qweight.shape[0], block_m)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    num_blocks = block_experts.numel()
    grid = (num_blocks * triton.cdiv(inter, tiles.gate_up.n),)
    args = (x, *weight_args(gate_up)[:3], h, sorted_pairs, block_experts, num_pairs, num_blocks,
            top_k, hidden, inter, gate_up.group_size, x.stride(0), *weight_args(gate_up)[3:],
            h.stride(0), *epilogue(biases, swiglu, x, "gate_up"))  # fmt: skip
    flags = dict(HAS_BIAS=biases is not None, SWIGLU=swiglu is not None)
    _launch(_int4_gate_up_kernel, grid, args, block_m, tiles.gate_up, gate_up, x, flags)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    grid = (num_blocks * triton.cdiv(hidden, tiles.down.n),)
    args = (h, *weight_args(down)[:3], out, weights.float().contiguous(), sorted_pairs,
            block_experts, num_pairs, num_blocks, inter, hidden, down.group_size, h.stride(0),
            *weight_args(down)[3:], out.stride(0),
            epilogue(biases, swiglu, x, "down")[0])  # fmt: skip
    _launch(_int4_down_kernel, grid, args, block_m, tiles.down, down, h,
            dict(HAS_BIAS=biases is not None))  # fmt: skip
    return sum_chosen(out, ids)


def _check(x: torch.Tensor, stack: Int4Stack, k: int) -> None:
    experts, n, words = stack.qweight.shape
    if stack.qweight.dtype != torch.int32 or words * PACK != k or x.shape[1] != k:
        raise ValueError(f"int4 experts' qweight {tuple(stack.qweight.shape)} must be int32 "
                         f"[E, N, {k} / {PACK}] against x {tuple(x.shape)}")  # fmt: skip
    if k % CHUNK or stack.group_size % CHUNK or k % stack.group_size:
        raise ValueError(f"int4 experts: K={k} and groups of {stack.group_size} must be "
                         f"multiples of {CHUNK}, K whole groups")  # fmt: skip
    groups = (experts, n, k // stack.group_size)
    if tuple(stack.scales.shape) != groups:
        raise ValueError(f"int4 experts' scales {tuple(stack.scales.shape)} are not {groups}")
    if stack.zeros is not None and (stack.zeros.shape != stack.scales.shape
                                    or stack.zeros.dtype != torch.uint8):  # fmt: skip
        raise ValueError(f"int4 experts' zeros must be uint8 {groups}")
    if stack.e2m1 and (stack.zeros is not None or stack.group_size != CHUNK):
        raise ValueError(f"MXFP4 experts have no zero points and groups of {CHUNK}")


def _step_columns(k: int, tiles: GemmTiles, on_gpu: bool) -> int:
    """K a step: the tiles' if it divides K, else the largest of 64 (32 interpreted) that
    does; the GPU's tl.dot takes no step below GPU_MIN_STEP, so where none divides K (a
    rank's 1,440 columns of gpt-oss's experts) the last step of GPU_MIN_STEP is masked."""
    for step in (tiles.k, 64, 32):
        if k % step == 0 and (step >= GPU_MIN_STEP or not on_gpu):
            return step
    return GPU_MIN_STEP


def _launch(
    kernel: triton.JITFunction,
    grid: tuple[int],
    args: tuple[object, ...],
    block_m: int,
    tiles: GemmTiles,
    stack: Int4Stack,
    x: torch.Tensor,
    flags: dict[str, bool],  # HAS_BIAS (and SWIGLU)
) -> None:
    """A grouped GEMM's launch, with fewer pipeline stages where the GPU lacks the shared
    memory for the tiles' (kernels/triton_stages.py)."""
    if tiles.swap_ab:
        raise ValueError("int4 experts' products are weights-first already: swap_ab is theirs")
    step = _step_columns(x.shape[1], tiles, x.is_cuda)
    sixteen_bit = x.dtype in (torch.bfloat16, torch.float16)
    fast = stack.group_size % step == 0 and (sixteen_bit or not x.is_cuda) and not stack.e2m1
    constants = dict(
        BLOCK_M=block_m, BLOCK_N=tiles.n, GROUP_M=tiles.group_m, WORDS=step // PACK,
        HAS_ZEROS=stack.zeros is not None, FAST=fast, E2M1=stack.e2m1, **flags,
        INTERPRETED=not x.is_cuda, num_warps=tiles.num_warps,
    )  # fmt: skip
    variant = (kernel.__name__, x.device, x.dtype, *constants.values())  # type: ignore[attr-defined]
    launch_fitting(
        variant,
        tiles.num_stages,
        lambda stages: kernel[grid](*args, **constants, num_stages=stages),
    )
