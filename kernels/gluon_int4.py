"""int4 weight-only linear layers of 65-512 rows on Hopper's warpgroup MMA, in Gluon.

Past kernels.triton_int4.DEQUANTIZE_ABOVE_ROWS rows the Triton path writes the whole weight out
in bf16 and cuBLAS reads it back: at 256 rows Qwen3-8B's layer takes 1.8x its bf16 time, where
the int4 weight is a quarter of the bytes. Triton's tl.dot could not take a weight made in
registers at that speed (a try was 1.3-3x slower than the pass, docs/benchmarks.md). This kernel
reads the packed weight once and feeds the tensor cores from it, as Marlin and Machete do:

    out^T [N, M] = W [N, K] x^T [K, M]     (the weight is the MMA's first operand, 64 rows a
                                            warpgroup; the rows of x its second, up to 256)

A program owns BLOCK_N weight rows and BLOCK_M rows of x and walks its share of K in steps of
BLOCK_K columns. TMA copies each step's x tile and packed words into a ring of STAGES shared
buffers, STAGES - 1 steps ahead. Each step the warps dequantize the words in registers (a
thread holds whole chunks of 4 words: the chunk interleave of kernels/int4.py is undone by
renaming registers, joins and permutes, not by moving data), store the tile into one of two
shared A buffers, and issue an asynchronous warpgroup MMA; it runs while the next step's words
are dequantized. The weight is rounded to x's dtype as the reference rounds it (the exact
(q - z) * s, rounded once: kernels/int4_pairs.py), the MMA sums in float32.

Narrow layers (qkv, o, down) have too few output tiles to fill the GPU: SPLIT_K programs share
a tile's K steps, and the last to finish adds their partial sums (kernels/triton_split_k.py's
protocol, in split order).

Selected only where it runs: CUDA compute capability 9.x, a Triton with Gluon's Hopper
modules, a bf16 or fp16 x, K and the group size multiples of BLOCK_K, no act-order. Elsewhere
the Triton path is the fallback (`kernels.triton_int4.int4_linear`), and that is what the CPU
tests cover; this kernel is tested against `kernels.int4.int4_linear_reference` on the GPU
(tests/kernels/test_gluon_int4.py) and compiled for sm_90 without one
(tests/kernels/target_compile.py).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from kernels import triton_split_k as split_k
from kernels.gluon_hopper import (
    TensorDescriptor,
    constexpr_function,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    runs_on,
    threads_barrier,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from kernels.int4 import PACK
from kernels.int4_pairs import BF16_SCALED_PAIRS_ASM, FP16_SCALED_PAIRS_ASM

# Whether the engine's int4 layers use this kernel between the Triton paths' bounds. On since
# the whole-step A/B (H100, 2026-12-06, scripts/device_ab.sh against a copy with it on,
# Qwen3-8B AWQ): `offline` 8,711 / 8,696 against 7,423 / 7,428 tok/s off; decode ITL at 96
# and 256 rows 8.42 and 12.94 ms against 14.47 and 18.32; batch 1 the same (3.34 ms).
ENABLED = True
# Rows it takes with ENABLED: from kernels.triton_int4.DEQUANTIZE_ABOVE_ROWS + 1 (below, the
# Triton dot kernel reads the weight once) to this; past it, prefill chunks: the dequantize pass
# is a small share of a compute-bound product, and the launches are eager (a TMA descriptor
# each costs the host).
MAX_ROWS = 512
BLOCK_K = 64  # a step: 128 bytes of bf16 a row, the widest swizzle; 8 words of a weight row
DTYPES = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class WgmmaTiles:
    block_m: int  # rows of x a program: 64, 128 or 256 (the MMA's N)
    block_n: int  # weight rows a program: 16 a warp
    num_warps: int  # 4 or 8: one or two warpgroups along the weight's rows
    stages: int  # the shared ring's steps
    split_k: int  # programs along K per output tile

    def __post_init__(self) -> None:
        if self.block_m not in (64, 128, 256) or self.block_n != 16 * self.num_warps:
            raise ValueError(f"{self}: block_m 64/128/256 and block_n 16 a warp")
        if self.num_warps not in (4, 8) or self.stages < 2 or self.split_k < 1:
            raise ValueError(f"{self}: 4 or 8 warps, at least 2 stages and 1 split")


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def applies(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None,
) -> bool:
    """Whether this kernel takes the call (the module's docstring: where it runs). The scales
    in x's dtype (the weights rounded as the reference rounds them); TMA reads the packed
    weight, so its rows start on 16 bytes."""
    k = x.shape[-1]
    return (
        runs_on(x)
        and x.dtype in DTYPES
        and scales.dtype == x.dtype
        and g_idx is None
        and k % BLOCK_K == 0
        and group_size % BLOCK_K == 0
        and qweight.data_ptr() % 16 == 0
        and qweight.stride(1) == 1
        and (qweight.stride(0) * qweight.element_size()) % 16 == 0
    )


def _check_layout(
    k: int,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
) -> None:
    """What the kernel indexes as kernels.triton_int4 checks it (a direct caller skips that)."""
    if k == 0 or qweight.shape[1] * PACK != k or scales.shape[1] * group_size < k:
        raise ValueError(f"qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)} "
                         f"in groups of {group_size} do not cover K={k}")  # fmt: skip
    if scales.stride(1) != 1 or (zeros is not None and zeros.stride(1) != 1):
        raise ValueError("scales and zeros must be contiguous along their groups")


def default_tiles(m: int, n: int, k: int, sm_count: int) -> WgmmaTiles:
    """The sweep's picks (`python -m sweeps.int4_sweep --model qwen3 --m 128 256 512
    --gluon-only`, H100, 2026-12-06: each within 4 % of the best of 48 tiles at Qwen3-8B's four
    layers): one warpgroup over 64 weight rows (twice the programs of two over 128), x's rows in
    one MMA up to 256; two warpgroups over 128 rows only where x spans several row tiles and
    64-row programs would pass a wave (x's tiles then read half as often). Three stages where
    128-row programs pass a wave (less shared memory a program). K split in two while the programs
    still fit one wave (at most 8 ways, each split a whole number of steps)."""
    block_m = 128 if m <= 128 else 256
    row_tiles = triton.cdiv(m, block_m)
    block_n, num_warps = 64, 4
    if row_tiles > 1 and triton.cdiv(n, block_n) * row_tiles > sm_count:
        block_n, num_warps = 128, 8
    tiles = triton.cdiv(n, block_n) * row_tiles
    steps = k // BLOCK_K
    split = 1
    while split < 8 and tiles * split * 2 <= sm_count and steps % (split * 2) == 0:
        split *= 2
    stages = 3 if block_m == 128 and tiles > sm_count else 4
    return WgmmaTiles(block_m, block_n, num_warps, stages, split_k=split)


def gluon_int4_linear(
    x: torch.Tensor,  # [M, K] bf16 or fp16
    qweight: torch.Tensor,  # [N, K/8] int32, kernels/int4.py's layout
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None,  # [N, G] uint8; None: 8
    group_size: int,
    g_idx: torch.Tensor | None = None,  # must be None (act-order: the Triton path)
    bias: torch.Tensor | None = None,  # [N]
    *,
    tiles: WgmmaTiles | None = None,  # None: default_tiles
) -> torch.Tensor:  # [M, N], x.dtype
    """`kernels.int4.int4_linear_reference` on Hopper's warpgroup MMA (the module's
    docstring). The caller checks `applies`; the inputs as kernels.triton_int4 checks them."""
    m, k = x.shape
    n = qweight.shape[0]
    if not applies(x, qweight, scales, group_size, g_idx):
        raise ValueError("gluon_int4_linear: not on this device or these inputs (`applies`)")
    _check_layout(k, qweight, scales, zeros, group_size)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if x.stride(1) != 1 or x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
        x = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)  # TMA: 16 B
    tiles = tiles or default_tiles(m, n, k, _sm_count(x.device.index or 0))
    if (k // BLOCK_K) % tiles.split_k:
        raise ValueError(f"{tiles}: split_k must divide K's {k // BLOCK_K} steps")
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    x_block, w_block = [tiles.block_m, BLOCK_K], [tiles.block_n, BLOCK_K // PACK]
    x_desc = TensorDescriptor.from_tensor(
        x, x_block, gl.NVMMASharedLayout.get_default_for(x_block, dtype)
    )
    w_desc = TensorDescriptor.from_tensor(
        qweight, w_block, gl.NVMMASharedLayout.get_default_for(w_block, gl.int32)
    )
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), tiles.split_k)
    partials, tickets = split_k.workspace(grid, m, n, out, tiles)
    _int4_wgmma_kernel[grid](
        x_desc, w_desc, scales,
        zeros if zeros is not None else scales,
        bias if bias is not None else scales,
        out, partials, tickets, m, n, k,
        scales.stride(0), zeros.stride(0) if zeros is not None else 0, out.stride(0),
        GROUP_SIZE=group_size,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None,
        SPLIT_K=tiles.split_k,
        STAGES=tiles.stages,
        num_warps=tiles.num_warps,
    )  # fmt: skip
    return out


if gluon is not None:

    @constexpr_function
    def _word_layout(words: int, num_warps: int) -> gl.BlockedLayout:
        """[BLOCK_N, WORDS] packed words: a thread holds whole chunks (4 words) of one row."""
        across = words // 4
        return gl.BlockedLayout([1, 4], [32 // across, across], [num_warps, 1], [1, 0])

    @constexpr_function
    def _mma_layout(block_m: int, num_warps: int) -> gl.NVMMADistributedLayout:
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 16]
        )

    @gluon.jit
    def _dequantize(words, scale, minus_offset, dtype: gl.constexpr):
        """[BN, W] words -> [BN, 8 W] weights (q - z) * s in column order, rounded to dtype as
        the reference rounds them: two nibbles cost a PRMT, a LOP3, a packed FMA and a packed
        multiply (kernels/int4_pairs.py). scale, minus_offset (-(BASE + z)): [BN, W] in dtype.
        Pair p holds nibbles 2p, 2p + 1 of each word; in a chunk of 4 words nibble 2p + h of
        word c holds column 8p + 2c + h (kernels/int4.py), and each thread holds whole
        chunks, so the joins and the permute only rename its registers."""
        BN: gl.constexpr = words.shape[0]
        W: gl.constexpr = words.shape[1]
        asm: gl.constexpr = FP16_SCALED_PAIRS_ASM if dtype == gl.float16 else BF16_SCALED_PAIRS_ASM
        p0, p1, p2, p3 = gl.inline_asm_elementwise(
            asm,
            "=r,=r,=r,=r,r,r,r,r",
            [
                gl.join(words, words >> 4),
                gl.join(minus_offset, minus_offset),
                gl.join(scale, scale),
            ],
            dtype=(dtype.value, dtype.value, dtype.value, dtype.value),  # constexpr: unwrapped
            is_pure=True,
            pack=2,
        )  # each [BN, W, h]
        w = gl.join(gl.join(p0, p1), gl.join(p2, p3))  # [BN, W, h, p_lo, p_hi]
        w = gl.reshape(w, [BN, W // 4, 4, 2, 2, 2])  # [BN, chunk, c, h, p_lo, p_hi]
        w = gl.permute(w, [0, 1, 5, 4, 2, 3])  # [BN, chunk, p_hi, p_lo, c, h]
        return gl.reshape(w, [BN, W * 8])

    @gluon.jit
    def _load_step(x_desc, w_desc, bar, x_buf, w_buf, off_m, off_n, k0, pred):
        """TMA: one step's x tile and packed words into a stage of the ring."""
        nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
        mbarrier.expect(bar, nbytes, pred=pred)
        tma_load(x_desc, [off_m, k0], bar, x_buf, pred=pred)
        tma_load(w_desc, [off_n, k0 // 8], bar, w_buf, pred=pred)

    @gluon.jit
    def _group_params(scales_ptr, zeros_ptr, cols, col_ok, group, stride_scales_row,
                      stride_zeros_row, HAS_ZEROS: gl.constexpr, dtype: gl.constexpr):  # fmt: skip
        """A group's scale and -(BASE + z) of each weight row [BN], in dtype (BASE: 1024 in
        fp16, 128 in bf16, so that z + BASE is exact)."""
        scale = gl.load(scales_ptr + cols * stride_scales_row + group, mask=col_ok, other=0.0)
        if HAS_ZEROS:
            zero = gl.load(zeros_ptr + cols * stride_zeros_row + group, mask=col_ok, other=0)
            zero = zero.to(gl.float32)
        else:
            zero = gl.full(cols.shape, 8.0, gl.float32, cols.type.layout)
        base: gl.constexpr = 1024.0 if dtype == gl.float16 else 128.0
        return scale.to(dtype), (-(zero + base)).to(dtype)

    @gluon.jit
    def _int4_wgmma_kernel(
        x_desc,  # TMA over x [M, K], blocks [BLOCK_M, BLOCK_K]
        w_desc,  # TMA over qweight [N, K/8] int32, blocks [BLOCK_N, BLOCK_K / 8]
        scales_ptr,  # [N, G]
        zeros_ptr,  # [N, G] uint8 with HAS_ZEROS
        bias_ptr,  # [N] with HAS_BIAS
        out_ptr,  # [M, N]
        partials_ptr,  # [SPLIT_K, N, M] float32 with SPLIT_K > 1 (a thread's pairs along M)
        tickets_ptr,  # [tiles] int32, zero between calls, with SPLIT_K > 1
        m,
        n,
        k,
        stride_scales_row,
        stride_zeros_row,
        stride_out_row,
        GROUP_SIZE: gl.constexpr,
        HAS_ZEROS: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        SPLIT_K: gl.constexpr,
        STAGES: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """out[rows, cols]^T = sum over this split's steps of W_step x_step^T (the module's
        docstring)."""
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K_: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        WORDS: gl.constexpr = w_desc.block_type.shape[1]
        dtype: gl.constexpr = x_desc.dtype
        word_layout: gl.constexpr = _word_layout(WORDS, num_warps)
        mma_layout: gl.constexpr = _mma_layout(BLOCK_M, num_warps)

        off_m = gl.program_id(0) * BLOCK_M
        off_n = gl.program_id(1) * BLOCK_N
        steps = k // BLOCK_K_ // SPLIT_K  # the launcher checks SPLIT_K divides K's steps
        k_first = gl.program_id(2) * steps * BLOCK_K_
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, word_layout))
        col_ok = cols < n

        x_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K_], x_desc.layout)
        w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, WORDS], w_desc.layout)
        # The dequantized tiles: rows of BLOCK_K_ values as x's (128 bytes), so x's swizzled
        # layout. Layouts are not passed as arguments: a jit cache hook (the engine's watch of
        # late compiles) makes Triton write the arguments as JSON, which a layout fails.
        a_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_K_], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        for s in gl.static_range(STAGES - 1):
            _load_step(x_desc, w_desc, ready.index(s), x_ring.index(s), w_ring.index(s),
                       off_m, off_n, k_first + s * BLOCK_K_, s < steps)  # fmt: skip

        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
        # Each step's scales and zero points are loaded a step ahead, while an MMA runs.
        scale, minus_offset = _group_params(
            scales_ptr, zeros_ptr, cols, col_ok, k_first // GROUP_SIZE, stride_scales_row,
            stride_zeros_row, HAS_ZEROS, dtype,
        )  # fmt: skip
        for i in range(steps):
            stage = i % STAGES
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            words = w_ring.index(stage).load(word_layout)
            a_buf = a_bufs.index(i % 2)
            a_buf.store(
                _dequantize(
                    words, gl.broadcast(scale[:, None], words)[0],
                    gl.broadcast(minus_offset[:, None], words)[0], dtype,
                )
            )  # fmt: skip
            fence_async_shared()
            x_t = x_ring.index(stage).permute((1, 0))  # [BLOCK_K, BLOCK_M]
            acc = warpgroup_mma(a_buf, x_t, acc, is_async=True)
            # Step i - 1's MMA is done: its A buffer and its stage are free. (Of both
            # warpgroups, and the words loaded by every thread: the thread barrier Triton puts
            # before the TMA issue below, as it does between the A stores and the MMA.)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            ahead = i + STAGES - 1
            free = ahead % STAGES
            _load_step(x_desc, w_desc, ready.index(free), x_ring.index(free), w_ring.index(free),
                       off_m, off_n, k_first + ahead * BLOCK_K_, ahead < steps)  # fmt: skip
            next_group = (k_first + gl.minimum(i + 1, steps - 1) * BLOCK_K_) // GROUP_SIZE
            scale, minus_offset = _group_params(
                scales_ptr, zeros_ptr, cols, col_ok, next_group, stride_scales_row,
                stride_zeros_row, HAS_ZEROS, dtype,
            )  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
        _write_tile(acc, bias_ptr, out_ptr, partials_ptr, tickets_ptr, off_m, off_n, m, n,
                    stride_out_row, HAS_BIAS, SPLIT_K, num_warps)  # fmt: skip

    @gluon.jit
    def _write_tile(acc, bias_ptr, out_ptr, partials_ptr, tickets_ptr, off_m, off_n, m, n,
                    stride_out_row, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr,
                    num_warps: gl.constexpr):  # fmt: skip
        """The tile into out; with SPLIT_K > 1 this split's partial sum, and the whole sum by
        the last split of the tile to finish. Stored from the MMA's own layout: a
        convert_layout through shared memory here made ptxas serialize the loop's MMAs
        (warning C7515, Triton 3.6, sm_90a)."""
        BLOCK_N: gl.constexpr = acc.shape[0]
        BLOCK_M: gl.constexpr = acc.shape[1]
        layout: gl.constexpr = _mma_layout(BLOCK_M, num_warps)
        tile = acc
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
        mask = (cols < n)[:, None] & (rows < m)[None, :]
        if SPLIT_K == 1:
            _store_out(tile, bias_ptr, out_ptr, cols, rows, mask, n, stride_out_row, HAS_BIAS)
        else:
            split = gl.program_id(2)
            gl.store(partials_ptr + (split * n + cols[:, None]) * m + rows[None, :], tile,
                     mask=mask)  # fmt: skip
            ticket_ptr = tickets_ptr + gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
            threads_barrier()  # every thread's partial stored before the ticket is taken
            last = gl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
            threads_barrier()
            if last:
                total = gl.zeros_like(tile)
                # In split order (the same sum each time); a loop, not unrolled: the unrolled
                # loads of 4-8 partial tiles spilled 0.7-1.9 KB a thread.
                for other in range(SPLIT_K):
                    part_ptrs = partials_ptr + (other * n + cols[:, None]) * m + rows[None, :]
                    total += gl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                gl.store(ticket_ptr, 0)
                _store_out(total, bias_ptr, out_ptr, cols, rows, mask, n, stride_out_row,
                           HAS_BIAS)  # fmt: skip

    @gluon.jit
    def _store_out(tile, bias_ptr, out_ptr, cols, rows, mask, n, stride_out_row,
                   HAS_BIAS: gl.constexpr):  # fmt: skip
        if HAS_BIAS:
            tile += gl.load(bias_ptr + cols, mask=cols < n, other=0.0).to(gl.float32)[:, None]
        out_ptrs = out_ptr + rows[None, :] * stride_out_row + cols[:, None]
        gl.store(out_ptrs, tile.to(out_ptr.dtype.element_ty), mask=mask)
