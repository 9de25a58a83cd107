"""A mixture of experts' grouped GEMMs on Hopper's warpgroup MMA, in Gluon: bf16, fp16 or FP8
(W8A8, a scale a row) experts with silu(gate) * up (Qwen3-MoE, Qwen2-MoE's routed experts,
Mixtral, OLMoE).

kernels/triton_moe.py's grouped GEMMs stream the chosen experts' weights at 69 % of the copy
bandwidth at 256 tokens of Qwen3-30B-A3B (H200, 2026-12-03: 411.8 us a layer, vLLM's 334.7,
the floor 283.1), and those steps are most of `offline`. Here each program's weight tiles come
by TMA into a ring of STAGES shared buffers, and the MMA takes the weight as its first operand
and the block's pairs as its second (out^T = W x^T: 64 weight rows a warpgroup, 16 to 128
pairs), so a block of few pairs wastes no MMA rows:

1. `align` (kernels/triton_moe_align.py): the pairs sorted by expert, each expert's group
   padded to BLOCK_M, each block's expert (-1 past the last group), as the Triton path.
2. `_wgmma_gate_up_kernel`: per block of BLOCK_M pairs and BLOCK_N of the expert's I columns, the
   gate and up rows' tiles (TMA) against the pairs' tokens' rows of x (gathered by
   asynchronous copies into the same ring), two accumulators; silu(gate) * up into h.
3. `_wgmma_down_kernel`: per block and BLOCK_N of the H columns, the down rows' tiles against the
   pairs' rows of h; times each pair's routing weight, into [pairs, H]; then each token's k
   rows are summed in float32 (as the Triton path).

FP8 MMAs add into their float32 accumulator at a reduced precision (Hopper keeps about 14 bits
of the sum's mantissa); over all of Qwen3-30B-A3B's K that missed the reference by over 1 %.
So each step's MMAs (BLOCK_K of K) start from zero and are added to the running sums in float32
registers (`max_num_imprecise_acc`), as the Triton path's `tl.dot` a step is; bf16 and fp16
MMAs accumulate in full float32 and are not split.

Selected only where it runs (CUDA compute capability 9.x, Gluon) and with ENABLED, for what
it covers (`applies`: no biases, plain SiLU, FP8 scales a row); elsewhere the Triton path is
the fallback and what the CPU tests cover. Tested against `kernels.moe.moe_experts_reference`
on the GPU (tests/kernels/test_gluon_moe.py) and compiled for sm_90 without one
(tests/kernels/target_compile.py).
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from kernels.fp8 import FP8
from kernels.gluon_hopper import (
    TensorDescriptor,
    async_copy,
    constexpr_function,
    copy_load,
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
from kernels.moe import ClampedSwiglu, ExpertBiases
from kernels.triton_fp8 import quantize_fp8_rowwise
from kernels.triton_moe_align import align

# Whether moe_experts takes this path. Off: a layer at Qwen3-30B-A3B's shape is slower than
# the Triton path's on an H100 (bf16, swept: 546.5 / 559.3 / 1,171.8 us at 256 / 1,024 / 4,096
# tokens against 526.5 / 527.9 / 1,124.2; docs/benchmarks.md, mixture of experts).
ENABLED = False
DTYPES = (torch.bfloat16, torch.float16)
# FP8 experts (accumulated per K step in float32 since 2026-12-06, within the reference): not
# taken either: in one lease on an H100 the Triton path's FP8 layer took 347.6 / 323.9 / 811.2
# us, this one's best tiles 347.4 / 330.6 / 853.7. `moe_experts_wgmma` runs them for the tests
# and sweeps.
FP8_TAKEN = False


@dataclasses.dataclass(frozen=True)
class WgmmaMoeTiles:
    block_m: int  # pairs a block (the MMA's N; align's block): 16, 32, 64 or 128
    block_n: int  # output columns a program: 16 a warp
    num_warps: int  # 4 or 8: one or two warpgroups along the weight's rows
    stages: int  # the shared ring's steps

    def __post_init__(self) -> None:
        if self.block_m not in (16, 32, 64, 128) or self.block_n != 16 * self.num_warps:
            raise ValueError(f"{self}: block_m 16/32/64/128 and block_n 16 a warp")
        if self.num_warps not in (4, 8) or self.stages < 2:
            raise ValueError(f"{self}: 4 or 8 warps and at least 2 stages")


# (at most this many pairs, tiles): blocks of about the pairs an expert gets (Qwen3-30B-A3B:
# 128 experts, top 8). Not yet swept on a GPU.
TILES: tuple[tuple[int, WgmmaMoeTiles], ...] = (
    (1024, WgmmaMoeTiles(16, 128, 8, 4)),
    (4096, WgmmaMoeTiles(32, 128, 8, 4)),
    (16384, WgmmaMoeTiles(64, 128, 8, 4)),
    (1 << 62, WgmmaMoeTiles(128, 128, 8, 3)),
)


def tiles_for(num_pairs: int) -> WgmmaMoeTiles:
    return next(tiles for most, tiles in TILES if num_pairs <= most)


def applies(
    x: torch.Tensor,
    gate_up: torch.Tensor,  # [E, 2 I, H]
    down: torch.Tensor,  # [E, H, I]
    gate_up_scale: torch.Tensor | None,  # [E, 2 I, G] float32: FP8 experts
    down_scale: torch.Tensor | None,
    biases: ExpertBiases | None,
    swiglu: ClampedSwiglu | None,
) -> bool:
    """Whether these kernels take the layer (the module's docstring): experts in x's 16-bit
    dtype, or FP8 with a scale a row (W8A8, as the Triton path); no biases, SiLU. TMA reads
    the experts as 2-D row-major tensors, and the rows gathered are copied 16 bytes at a time
    (H and I multiples of 16 bytes' elements)."""
    hidden, inter = down.shape[1], down.shape[2]
    if gate_up_scale is None or down_scale is None:
        experts_ok = gate_up.dtype == down.dtype == x.dtype and gate_up_scale is down_scale
    else:  # float32 [E, rows, 1], read as [E * rows]
        experts_ok = (
            FP8_TAKEN
            and gate_up.dtype == down.dtype == FP8
            and gate_up_scale.shape == (*gate_up.shape[:2], 1)
            and down_scale.shape == (*down.shape[:2], 1)
            and gate_up_scale.dtype == down_scale.dtype == torch.float32
            and gate_up_scale.is_contiguous()
            and down_scale.is_contiguous()
        )
    vec = 16 // gate_up.element_size()
    return (
        runs_on(x)
        and x.dtype in DTYPES
        and experts_ok
        and biases is None
        and swiglu is None
        and gate_up.is_contiguous()
        and down.is_contiguous()
        and gate_up.data_ptr() % 16 == down.data_ptr() % 16 == 0
        and hidden % vec == 0
        and inter % vec == 0
    )


def moe_experts_wgmma(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2 I, H]
    down: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k]
    gate_up_scale: torch.Tensor | None = None,  # [E, 2 I, 1] float32: FP8 experts
    down_scale: torch.Tensor | None = None,  # [E, H, 1]
    tiles: WgmmaMoeTiles | None = None,  # None: by the pair count (TILES)
) -> torch.Tensor:  # [T, H], x's dtype
    """`kernels.moe.moe_experts_reference` for what `applies` takes (the module's docstring).
    FP8 experts are W8A8: x and then h are rounded to e4m3 a row at a time, and each product
    is scaled by its weight row's and input row's scales after the loop."""
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = down.shape
    num_pairs = num_tokens * top_k
    tiles = tiles or tiles_for(num_pairs)
    fp8 = gate_up_scale is not None
    sorted_pairs, block_experts = align(ids, num_experts, tiles.block_m)
    if x.stride(1) != 1 or x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
        x = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)  # 16-byte rows
    rows, rows_scale = _kernel_input(x, fp8)
    gate_scale = gate_up_scale if gate_up_scale is not None else rows_scale
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    grid = (block_experts.numel(), triton.cdiv(inter, tiles.block_n))
    w_desc, constants = _launch_setup(gate_up, hidden, tiles, fp8)
    _wgmma_gate_up_kernel[grid](
        w_desc, rows, h, gate_scale, rows_scale, sorted_pairs, block_experts, num_pairs, top_k,
        hidden, inter, rows.stride(0), h.stride(0), **constants,
    )  # fmt: skip
    rows, rows_scale = _kernel_input(h, fp8)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    grid = (block_experts.numel(), triton.cdiv(hidden, tiles.block_n))
    w_desc, constants = _launch_setup(down, inter, tiles, fp8)
    _wgmma_down_kernel[grid](
        w_desc, rows, out, down_scale if down_scale is not None else rows_scale, rows_scale,
        weights.float().contiguous(), sorted_pairs, block_experts, num_pairs, inter, hidden,
        rows.stride(0), out.stride(0), **constants,
    )  # fmt: skip
    return out.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


def _kernel_input(rows: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A GEMM's input rows as the kernel reads them, and their scales: e4m3 a row at a time
    for FP8 experts; else as they are (the scales a stand-in the kernel does not read)."""
    if fp8:
        return quantize_fp8_rowwise(rows)
    return rows, rows.new_empty(1, dtype=torch.float32)


def _launch_setup(
    experts: torch.Tensor, k: int, tiles: WgmmaMoeTiles, fp8: bool
) -> tuple[object, dict[str, object]]:
    """The TMA descriptor over the experts' rows ([E * rows, K]) and the kernels' constants:
    a K step of 128 bytes (64 16-bit values, 128 e4m3)."""
    dtype = gl.float8e4nv if fp8 else gl.bfloat16 if experts.dtype == torch.bfloat16 else gl.float16
    block_k = 128 // experts.element_size()
    block = [tiles.block_n, block_k]
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    w_desc = TensorDescriptor.from_tensor(experts.view(-1, k), block, layout)
    constants = dict(BLOCK_M=tiles.block_m, STAGES=tiles.stages, FP8=fp8,
                     num_warps=tiles.num_warps)  # fmt: skip
    return w_desc, constants


if gluon is not None:

    @constexpr_function
    def _rows_layout(block_m: int, block_k: int, vec: int, num_warps: int) -> gl.BlockedLayout:
        """[BLOCK_M, BLOCK_K] gathered rows: runs of up to `vec` elements (16-byte copies)
        along K, no thread copying what another does."""
        each = max(1, min(vec, block_m * block_k // (32 * num_warps)))
        along_k = min(32, block_k // each)
        return gl.BlockedLayout([1, each], [32 // along_k, along_k], [num_warps, 1], [1, 0])

    @constexpr_function
    def _mma_layout(block_m: int, bits: int, num_warps: int) -> gl.NVMMADistributedLayout:
        """The accumulator [BLOCK_N, BLOCK_M]: an instruction takes 32 bytes of K."""
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 256 // bits]
        )

    @gluon.jit
    def _load_step(w_desc, w_row, bar, w_buf, w_row_2, w_buf_2, row_ptrs, rows_ok, ks, k0,
                   K, rows_buf, pred, TWO: gl.constexpr):  # fmt: skip
        """One step into a stage of the ring: the weight tile(s) by TMA (told to `bar`), the
        pairs' rows by asynchronous copies (one commit group a step, also when `pred` is
        false, so that the group count is the step count)."""
        nbytes: gl.constexpr = w_desc.block_type.nbytes * (2 if TWO else 1)
        mbarrier.expect(bar, nbytes, pred=pred)
        tma_load(w_desc, [w_row, k0], bar, w_buf, pred=pred)
        if TWO:
            tma_load(w_desc, [w_row_2, k0], bar, w_buf_2, pred=pred)
        # K a multiple of VEC (16 bytes, `applies`), written so the compiler sees it: the
        # mask holds for runs of VEC, and the copies take 16 bytes.
        VEC: gl.constexpr = 128 // rows_buf.dtype.primitive_bitwidth
        mask = rows_ok[:, None] & ((k0 + ks) < (K // VEC) * VEC)[None, :] & pred
        copy_load(rows_buf, row_ptrs + (k0 + ks)[None, :], mask=mask)
        async_copy.commit_group()

    @gluon.jit
    def _ring(w_desc, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, TWO: gl.constexpr):
        """The ring's shared buffers: a stage's weight tile (and a second one with TWO), the
        pairs' rows, and its barrier (initialized)."""
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        shape: gl.constexpr = [STAGES, BLOCK_N, BLOCK_K]
        w_ring = gl.allocate_shared_memory(w_desc.dtype, shape, w_desc.layout)
        w_ring_2 = w_ring
        if TWO:
            w_ring_2 = gl.allocate_shared_memory(w_desc.dtype, shape, w_desc.layout)
        rows_shape: gl.constexpr = [STAGES, BLOCK_M, BLOCK_K]
        # Rows of 128 bytes as the weight tiles', so their swizzled layout. Layouts are not
        # passed as arguments: a jit cache hook (the engine's watch of late compiles) makes
        # Triton write the arguments as JSON, which a layout fails.
        rows_ring = gl.allocate_shared_memory(w_desc.dtype, rows_shape, w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        return w_ring, w_ring_2, rows_ring, ready

    @gluon.jit
    def _step_ready(ready, stage, i, STAGES: gl.constexpr):
        """Step i's stage is in: its TMA (the barrier), this thread's copies (all but the
        STAGES - 2 later groups), every thread's (the barrier of threads), visible to the
        MMA's asynchronous reads (the fence)."""
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        async_copy.wait_group(STAGES - 2)
        fence_async_shared()
        threads_barrier()

    # The pair count is not specialized, as in kernels/triton_moe.py: the warm-up's steps then
    # meet every variant a tile set has.
    @gluon.jit(do_not_specialize=["num_pairs"])
    def _wgmma_gate_up_kernel(
        w_desc,  # TMA over gate_up [E * 2I, H], blocks [BLOCK_N, BLOCK_K]
        x_ptr,  # [T, H]: e4m3 with FP8
        h_ptr,  # [pairs, I]
        w_scale_ptr,  # [E * 2I] float32 with FP8: each weight row's
        x_scale_ptr,  # [T] float32 with FP8: each row of x's
        sorted_ptr,  # [P] int32
        block_expert_ptr,  # [P / BLOCK_M] int32
        num_pairs,
        top_k,
        K,  # H
        N,  # I
        stride_x,
        stride_h,
        BLOCK_M: gl.constexpr,
        STAGES: gl.constexpr,
        FP8: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """h[pairs, cols] = silu(x W_gate^T) * (x W_up^T) for this block's pairs, its expert's
        gate and up rows cols (the module's docstring, 2)."""
        expert = gl.load(block_expert_ptr + gl.program_id(0))
        if expert >= 0:  # blocks past the last group have no pairs
            BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
            BLOCK_K_: gl.constexpr = w_desc.block_type.shape[1]
            dtype: gl.constexpr = w_desc.dtype
            VEC: gl.constexpr = 128 // dtype.primitive_bitwidth  # elements in 16 bytes
            rows_layout: gl.constexpr = _rows_layout(BLOCK_M, BLOCK_K_, VEC, num_warps)
            mma_layout: gl.constexpr = _mma_layout(BLOCK_M, dtype.primitive_bitwidth, num_warps)
            pairs, rows_ok = _block_rows(sorted_ptr, gl.program_id(0), num_pairs, BLOCK_M,
                                         gl.SliceLayout(1, rows_layout))  # fmt: skip
            tokens = gl.where(rows_ok, pairs // top_k, 0).to(gl.int64)
            # Rows of 16-byte multiples (`applies`), written so: 16-byte copies.
            row_ptrs = x_ptr + tokens[:, None] * ((stride_x // VEC) * VEC)
            ks = gl.arange(0, BLOCK_K_, layout=gl.SliceLayout(0, rows_layout))
            off_n = gl.program_id(1) * BLOCK_N
            gate_row = expert * 2 * N + off_n
            up_row = gate_row + N

            gate_ring, up_ring, rows_ring, ready = _ring(w_desc, BLOCK_M, STAGES, True)
            steps = gl.cdiv(K, BLOCK_K_)
            for s in gl.static_range(STAGES - 1):
                _load_step(w_desc, gate_row, ready.index(s), gate_ring.index(s), up_row,
                           up_ring.index(s), row_ptrs, rows_ok, ks, s * BLOCK_K_, K,
                           rows_ring.index(s), s < steps, True)  # fmt: skip

            gate = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
            up = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
            for i in range(steps):
                stage = i % STAGES
                _step_ready(ready, stage, i, STAGES)
                rows_t = rows_ring.index(stage).permute((1, 0))  # [BLOCK_K, BLOCK_M]
                gate = warpgroup_mma(gate_ring.index(stage), rows_t, gate, is_async=True,
                                     max_num_imprecise_acc=BLOCK_K_)  # fmt: skip
                up = warpgroup_mma(up_ring.index(stage), rows_t, up, is_async=True,
                                   max_num_imprecise_acc=BLOCK_K_)  # fmt: skip
                gate, up = warpgroup_mma_wait(num_outstanding=2, deps=(gate, up))
                # Step i - 1's MMAs are done in this warpgroup; the barrier: in both, before
                # any thread copies into their stage.
                threads_barrier()
                ahead = i + STAGES - 1
                free = ahead % STAGES
                _load_step(w_desc, gate_row, ready.index(free), gate_ring.index(free), up_row,
                           up_ring.index(free), row_ptrs, rows_ok, ks, ahead * BLOCK_K_, K,
                           rows_ring.index(free), ahead < steps, True)  # fmt: skip
            gate, up = warpgroup_mma_wait(num_outstanding=0, deps=(gate, up))
            async_copy.wait_group(0)
            for s in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(s))
            cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout))
            pairs_out, pairs_ok = _block_rows(sorted_ptr, gl.program_id(0), num_pairs, BLOCK_M,
                                              gl.SliceLayout(0, mma_layout))  # fmt: skip
            if FP8:  # each product times its weight row's and its x row's scales
                x_scale = gl.load(x_scale_ptr + pairs_out // top_k, mask=pairs_ok, other=0.0)
                gate_scale = gl.load(w_scale_ptr + (cols - off_n) + gate_row, mask=cols < N)
                up_scale = gl.load(w_scale_ptr + (cols - off_n) + up_row, mask=cols < N)
                gate = gate * gate_scale[:, None] * x_scale[None, :]
                up = up * up_scale[:, None] * x_scale[None, :]
            hidden = gate / (1.0 + gl.exp(-gate)) * up
            _store_rows(hidden, h_ptr, cols, N, stride_h, pairs_out, pairs_ok)

    @gluon.jit
    def _block_rows(sorted_ptr, block, num_pairs, BLOCK_M: gl.constexpr, layout: gl.constexpr):
        """The block's pairs [BLOCK_M] in `layout` (a slice of a 2-D layout), and which are
        real (padding slots hold the pair count)."""
        slots = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=layout)
        pairs = gl.load(sorted_ptr + slots)
        return pairs, pairs < num_pairs

    @gluon.jit
    def _store_rows(tile, out_ptr, cols, N, stride_out, pairs, pairs_ok):
        """tile [BLOCK_N, BLOCK_M] (output columns by pairs) into the pairs' rows of out,
        from the MMA's own layout (a layout conversion through shared memory here made ptxas
        serialize the loop's MMAs in kernels/gluon_int4.py)."""
        mask = (cols < N)[:, None] & pairs_ok[None, :]
        ptrs = out_ptr + pairs.to(gl.int64)[None, :] * stride_out + cols[:, None]
        gl.store(ptrs, tile.to(out_ptr.dtype.element_ty), mask=mask)

    @gluon.jit(do_not_specialize=["num_pairs"])
    def _wgmma_down_kernel(
        w_desc,  # TMA over down [E * H, I], blocks [BLOCK_N, BLOCK_K]
        h_ptr,  # [pairs, I]: e4m3 with FP8
        out_ptr,  # [pairs, H]
        w_scale_ptr,  # [E * H] float32 with FP8
        h_scale_ptr,  # [pairs] float32 with FP8
        weights_ptr,  # [pairs] float32: each pair's routing weight
        sorted_ptr,
        block_expert_ptr,
        num_pairs,
        K,  # I
        N,  # H
        stride_h,
        stride_out,
        BLOCK_M: gl.constexpr,
        STAGES: gl.constexpr,
        FP8: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """out[pairs, cols] = weight * (h W_down^T) for this block's pairs, its expert's down
        rows cols (the module's docstring, 3)."""
        expert = gl.load(block_expert_ptr + gl.program_id(0))
        if expert >= 0:
            BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
            BLOCK_K_: gl.constexpr = w_desc.block_type.shape[1]
            dtype: gl.constexpr = w_desc.dtype
            VEC: gl.constexpr = 128 // dtype.primitive_bitwidth
            rows_layout: gl.constexpr = _rows_layout(BLOCK_M, BLOCK_K_, VEC, num_warps)
            mma_layout: gl.constexpr = _mma_layout(BLOCK_M, dtype.primitive_bitwidth, num_warps)
            pairs, rows_ok = _block_rows(sorted_ptr, gl.program_id(0), num_pairs, BLOCK_M,
                                         gl.SliceLayout(1, rows_layout))  # fmt: skip
            rows = gl.where(rows_ok, pairs, 0).to(gl.int64)
            row_ptrs = h_ptr + rows[:, None] * ((stride_h // VEC) * VEC)  # 16-byte copies
            ks = gl.arange(0, BLOCK_K_, layout=gl.SliceLayout(0, rows_layout))
            off_n = gl.program_id(1) * BLOCK_N
            w_row = expert * N + off_n

            w_ring, _, rows_ring, ready = _ring(w_desc, BLOCK_M, STAGES, False)
            steps = gl.cdiv(K, BLOCK_K_)
            for s in gl.static_range(STAGES - 1):
                _load_step(w_desc, w_row, ready.index(s), w_ring.index(s), w_row,
                           w_ring.index(s), row_ptrs, rows_ok, ks, s * BLOCK_K_, K,
                           rows_ring.index(s), s < steps, False)  # fmt: skip

            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
            for i in range(steps):
                stage = i % STAGES
                _step_ready(ready, stage, i, STAGES)
                rows_t = rows_ring.index(stage).permute((1, 0))
                acc = warpgroup_mma(w_ring.index(stage), rows_t, acc, is_async=True,
                                    max_num_imprecise_acc=BLOCK_K_)  # fmt: skip
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                threads_barrier()  # step i - 1's MMA done in both warpgroups
                ahead = i + STAGES - 1
                free = ahead % STAGES
                _load_step(w_desc, w_row, ready.index(free), w_ring.index(free), w_row,
                           w_ring.index(free), row_ptrs, rows_ok, ks, ahead * BLOCK_K_, K,
                           rows_ring.index(free), ahead < steps, False)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            async_copy.wait_group(0)
            for s in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(s))
            cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout))
            pairs_out, pairs_ok = _block_rows(sorted_ptr, gl.program_id(0), num_pairs, BLOCK_M,
                                              gl.SliceLayout(0, mma_layout))  # fmt: skip
            weight = gl.load(weights_ptr + pairs_out, mask=pairs_ok, other=0.0)
            if FP8:
                weight *= gl.load(h_scale_ptr + pairs_out, mask=pairs_ok, other=0.0)
                acc = acc * gl.load(w_scale_ptr + (cols - off_n) + w_row, mask=cols < N)[:, None]
            _store_rows(acc * weight[None, :], out_ptr, cols, N, stride_out, pairs_out, pairs_ok)
