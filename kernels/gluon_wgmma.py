"""What kvflow's weight-first Gluon GEMMs on Hopper share (kernels/gluon_int4.py,
kernels/gluon_fp8.py): out^T [N, M] = W [N, K] x^T [K, M], the weight the warpgroup MMA's first
operand (64 rows a warpgroup), the rows of x its second (up to 256). Their tiles, the default
choice of them, the MMA's register layout, and the output tile: written directly, or with K
split among programs as a partial sum each, added up by the last program of the tile to finish
(kernels/triton_split_k.py's protocol, in split order). The FP8 kernel's tile is scaled by its
weight rows' and x rows' scales as it is written."""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from kernels.gluon_hopper import constexpr_function, gl, gluon, threads_barrier


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
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_tiles(m: int, n: int, k: int, sms: int, block_k: int) -> WgmmaTiles:
    """The int4 sweep's picks (`python -m sweeps.int4_sweep --model qwen3 --m 128 256 512
    --gluon-only`, H100, 2026-12-06: each within 4 % of the best of 48 tiles at Qwen3-8B's four
    layers): one warpgroup over 64 weight rows (twice the programs of two over 128), x's rows in
    one MMA up to 256; two warpgroups over 128 rows only where x spans several row tiles and
    64-row programs would pass a wave (x's tiles then read half as often). Three stages where
    128-row programs pass a wave (less shared memory a program). K split in two while the programs
    still fit one wave (at most 8 ways, each split a whole number of steps of block_k)."""
    block_m = 128 if m <= 128 else 256
    row_tiles = triton.cdiv(m, block_m)
    block_n, num_warps = 64, 4
    if row_tiles > 1 and triton.cdiv(n, block_n) * row_tiles > sms:
        block_n, num_warps = 128, 8
    tiles = triton.cdiv(n, block_n) * row_tiles
    steps = k // block_k
    split = 1
    while split < 8 and tiles * split * 2 <= sms and steps % (split * 2) == 0:
        split *= 2
    stages = 3 if block_m == 128 and tiles > sms else 4
    return WgmmaTiles(block_m, block_n, num_warps, stages, split_k=split)


if gluon is not None:

    @constexpr_function
    def mma_layout(block_m: int, num_warps: int, instr_k: int) -> gl.NVMMADistributedLayout:
        """The accumulator's layout: [weight rows, x rows], instr_k the K of one MMA (16 for
        16-bit operands, 32 for 8-bit)."""
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, instr_k]
        )

    @gluon.jit
    def write_tile(acc, bias_ptr, out_ptr, partials_ptr, tickets_ptr, off_m, off_n, m, n,
                   stride_out_row, col_scale_ptr, row_scale_ptr, HAS_BIAS: gl.constexpr,
                   SCALED: gl.constexpr, SPLIT_K: gl.constexpr, num_warps: gl.constexpr,
                   instr_k: gl.constexpr):  # fmt: skip
        """The tile into out; with SPLIT_K > 1 this split's partial sum, and the whole sum by
        the last split of the tile to finish. Stored from the MMA's own layout: a
        convert_layout through shared memory here made ptxas serialize the loop's MMAs
        (warning C7515, Triton 3.6, sm_90a)."""
        BLOCK_N: gl.constexpr = acc.shape[0]
        BLOCK_M: gl.constexpr = acc.shape[1]
        layout: gl.constexpr = mma_layout(BLOCK_M, num_warps, instr_k)
        tile = acc
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
        mask = (cols < n)[:, None] & (rows < m)[None, :]
        if SPLIT_K == 1:
            _store_out(tile, bias_ptr, out_ptr, cols, rows, mask, n, m, stride_out_row,
                       col_scale_ptr, row_scale_ptr, HAS_BIAS, SCALED)  # fmt: skip
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
                _store_out(total, bias_ptr, out_ptr, cols, rows, mask, n, m, stride_out_row,
                           col_scale_ptr, row_scale_ptr, HAS_BIAS, SCALED)  # fmt: skip

    @gluon.jit
    def _store_out(tile, bias_ptr, out_ptr, cols, rows, mask, n, m, stride_out_row,
                   col_scale_ptr, row_scale_ptr, HAS_BIAS: gl.constexpr,
                   SCALED: gl.constexpr):  # fmt: skip
        """tile [weight rows, x rows] (times the weight rows' and x rows' scales, SCALED),
        plus the bias, into out [M, N] in its dtype."""
        if SCALED:
            col_scale = gl.load(col_scale_ptr + cols, mask=cols < n, other=0.0)
            row_scale = gl.load(row_scale_ptr + rows, mask=rows < m, other=0.0)
            tile = tile * col_scale[:, None] * row_scale[None, :]
        if HAS_BIAS:
            tile += gl.load(bias_ptr + cols, mask=cols < n, other=0.0).to(gl.float32)[:, None]
        out_ptrs = out_ptr + rows[None, :] * stride_out_row + cols[:, None]
        gl.store(out_ptrs, tile.to(out_ptr.dtype.element_ty), mask=mask)
