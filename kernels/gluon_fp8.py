"""FP8 W8A8 linear layers of 65-512 rows on Hopper's warpgroup MMA, in Gluon.

Past kernels.quantized_ops.FP8_SKINNY_MAX_ROWS rows an FP8 layer ran cuBLASLt's row-wise
scaled GEMM (`torch._scaled_mm`): at a decode step of 256 rows Qwen3-8B's FP8 GEMMs took 4.09
ms on an H100 (2026-12-06), 1.7x their weights' bytes over copy bandwidth. This kernel is the
weight-first GEMM of kernels/gluon_wgmma.py with both operands in e4m3, as the MMA reads them:

    out^T [N, M] = W [N, K] q^T [K, M] * w_scale [N] * q_scale [M]   (+ bias)

A program owns BLOCK_N weight rows and BLOCK_M rows of the quantized x and walks its share of K
in steps of 128 columns (128 bytes a row, the widest swizzle). TMA copies each step's tiles into
a ring of STAGES shared buffers, STAGES - 1 steps ahead; each step is one asynchronous MMA from
shared memory, whose stage is refilled once the MMA after it has started. The sum is float32;
both scales multiply it when the tile is written (as kernels.fp8.fp8_linear_reference does).
Narrow layers split K among programs (kernels/gluon_wgmma.py).

Selected only where it runs: CUDA compute capability 9.x, a Triton with Gluon's Hopper modules,
a bf16 output, K a multiple of 128, no static input scale needed (the caller quantized x).
Elsewhere cuBLASLt's GEMM is the path; this kernel is tested against the reference on the GPU
(tests/kernels/test_gluon_fp8.py) and compiled for sm_90 without one
(tests/kernels/target_compile.py).
"""

from __future__ import annotations

import torch
import triton

from kernels import gluon_wgmma as wgmma
from kernels import triton_split_k as split_k
from kernels.fp8 import FP8, Fp8Rows
from kernels.gluon_hopper import (
    TensorDescriptor,
    gl,
    gluon,
    mbarrier,
    runs_on,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from kernels.gluon_wgmma import WgmmaTiles

# Whether the engine's FP8 layers use this kernel between FP8_SKINNY_MAX_ROWS and MAX_ROWS rows.
ENABLED = False  # tried on an H100 on 2026-12-07: slower than cuBLASLt at 256 rows (docs)
# Past it, prefill chunks: cuBLASLt's GEMM is compute-bound there, and each launch here builds
# TMA descriptors on the host.
MAX_ROWS = 512
BLOCK_K = 128  # a step: 128 bytes of e4m3 a row, the widest swizzle


def applies(rows: Fp8Rows, qweight: torch.Tensor) -> bool:
    """Whether this kernel takes the call (the module's docstring: where it runs). TMA reads
    both operands: their rows start on 16 bytes."""
    k = rows.q.shape[1]
    return (
        runs_on(rows.q)
        and rows.dtype == torch.bfloat16
        and qweight.dtype == FP8
        and k % BLOCK_K == 0
        and all(
            t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0
            for t in (rows.q, qweight)
        )
    )


def default_tiles(m: int, n: int, k: int, sm_count: int) -> WgmmaTiles:
    """kernels.gluon_wgmma.default_tiles by K steps of BLOCK_K (not yet swept for FP8)."""
    return wgmma.default_tiles(m, n, k, sm_count, BLOCK_K)


def gluon_fp8_linear(
    rows: Fp8Rows,  # x [M, K] quantized per token: q e4m3, scale [M, 1] float32
    qweight: torch.Tensor,  # [N, K] e4m3
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
    *,
    tiles: WgmmaTiles | None = None,  # None: default_tiles
) -> torch.Tensor:  # [M, N] bf16
    """`kernels.fp8.fp8_linear_reference` on Hopper's warpgroup MMA (the module's docstring).
    The caller checks `applies`."""
    if not applies(rows, qweight):
        raise ValueError("gluon_fp8_linear: not on this device or these inputs (`applies`)")
    m, k = rows.q.shape
    n = qweight.shape[0]
    if qweight.shape[1] != k or weight_scale.numel() != n:
        raise ValueError(f"qweight {tuple(qweight.shape)} and its {weight_scale.numel()} "
                         f"scales do not fit x's K={k}")  # fmt: skip
    out = torch.empty((m, n), dtype=rows.dtype, device=rows.q.device)
    if m == 0 or n == 0:
        return out
    tiles = tiles or default_tiles(m, n, k, wgmma.sm_count(rows.q.device.index or 0))
    if (k // BLOCK_K) % tiles.split_k:
        raise ValueError(f"{tiles}: split_k must divide K's {k // BLOCK_K} steps")
    x_block, w_block = [tiles.block_m, BLOCK_K], [tiles.block_n, BLOCK_K]
    x_desc = TensorDescriptor.from_tensor(
        rows.q, x_block, gl.NVMMASharedLayout.get_default_for(x_block, gl.float8e4nv)
    )
    w_desc = TensorDescriptor.from_tensor(
        qweight, w_block, gl.NVMMASharedLayout.get_default_for(w_block, gl.float8e4nv)
    )
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), tiles.split_k)
    partials, tickets = split_k.workspace(grid, m, n, out, tiles)
    x_scale = rows.scale.reshape(-1)
    w_scale = weight_scale.reshape(-1)
    if x_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise ValueError("FP8 scales are float32")
    _fp8_wgmma_kernel[grid](
        x_desc, w_desc, x_scale.contiguous(), w_scale.contiguous(),
        bias if bias is not None else w_scale, out, partials, tickets, m, n, k, out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=tiles.split_k, STAGES=tiles.stages,
        num_warps=tiles.num_warps,
    )  # fmt: skip
    return out


if gluon is not None:

    @gluon.jit
    def _load_step(x_desc, w_desc, bar, x_buf, w_buf, off_m, off_n, k0, pred):
        """TMA: one step's tiles of x and of the weight into a stage of the ring."""
        nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
        mbarrier.expect(bar, nbytes, pred=pred)
        tma_load(x_desc, [off_m, k0], bar, x_buf, pred=pred)
        tma_load(w_desc, [off_n, k0], bar, w_buf, pred=pred)

    @gluon.jit
    def _fp8_wgmma_kernel(
        x_desc,  # TMA over x's e4m3 rows [M, K], blocks [BLOCK_M, BLOCK_K]
        w_desc,  # TMA over the e4m3 weight [N, K], blocks [BLOCK_N, BLOCK_K]
        x_scale_ptr,  # [M] float32
        w_scale_ptr,  # [N] float32
        bias_ptr,  # [N] with HAS_BIAS
        out_ptr,  # [M, N]
        partials_ptr,  # [SPLIT_K, N, M] float32 with SPLIT_K > 1
        tickets_ptr,  # [tiles] int32, zero between calls, with SPLIT_K > 1
        m,
        n,
        k,
        stride_out_row,
        HAS_BIAS: gl.constexpr,
        SPLIT_K: gl.constexpr,
        STAGES: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """out[rows, cols]^T = the scales times the sum over this split's steps of
        W_step q_step^T (the module's docstring)."""
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K_: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        mma_layout: gl.constexpr = wgmma.mma_layout(BLOCK_M, num_warps, 32)  # 8-bit MMAs: K 32

        off_m = gl.program_id(0) * BLOCK_M
        off_n = gl.program_id(1) * BLOCK_N
        steps = k // BLOCK_K_ // SPLIT_K  # the launcher checks SPLIT_K divides K's steps
        k_first = gl.program_id(2) * steps * BLOCK_K_

        x_ring = gl.allocate_shared_memory(
            gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K_], x_desc.layout
        )
        w_ring = gl.allocate_shared_memory(
            gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K_], w_desc.layout
        )
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        for s in gl.static_range(STAGES - 1):
            _load_step(x_desc, w_desc, ready.index(s), x_ring.index(s), w_ring.index(s),
                       off_m, off_n, k_first + s * BLOCK_K_, s < steps)  # fmt: skip

        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
        for i in range(steps):
            stage = i % STAGES
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            x_t = x_ring.index(stage).permute((1, 0))  # [BLOCK_K, BLOCK_M], K-major
            acc = warpgroup_mma(w_ring.index(stage), x_t, acc, is_async=True)
            # Step i - 1's MMA is done: its stage is free for step i + STAGES - 1.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            ahead = i + STAGES - 1
            free = ahead % STAGES
            _load_step(x_desc, w_desc, ready.index(free), x_ring.index(free), w_ring.index(free),
                       off_m, off_n, k_first + ahead * BLOCK_K_, ahead < steps)  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
        wgmma.write_tile(acc, bias_ptr, out_ptr, partials_ptr, tickets_ptr, off_m, off_n, m, n,
                         stride_out_row, w_scale_ptr, x_scale_ptr, HAS_BIAS, True, SPLIT_K,
                         num_warps, 32)  # fmt: skip
