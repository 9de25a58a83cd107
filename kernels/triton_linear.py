"""A "skinny" linear layer for decode (1 <= M <= 64 rows), in Triton, streaming the weights once.

Same math as `kernels.linear.linear_reference`. At decode batch sizes a linear layer is a
weight-bandwidth problem: each weight is used by at most 64 rows, so the kernel is built to
keep many weight bytes in flight, and nothing else. One program owns BLOCK_N output columns
(BLOCK_N weight rows) and walks K; every program reads the whole (tiny) x:

    weight [N, K], row-major                     x [M, K], rows >= M masked
    +-------------------------------+            +--------------------+
    | program 0: rows 0 .. BN-1     |  --> out[:, 0 .. BN-1]        | reread from L2
    | program 1: rows BN .. 2BN-1   |  --> out[:, BN .. 2BN-1]      | by every program
    | ...   walked in BLOCK_K steps |            +--------------------+
    +-------------------------------+

Two inner products, picked by `LinearTiles.use_dot`:
  dot  acc[BM, BN] += x[BM, BK] @ w[BN, BK]^T with tl.dot (tensor cores; the x tile is M padded
       to 16, 32 or 64 rows, 16 being the minimum of tl.dot, so three compiles serve every M).
       Triton pipelines the weight loads into shared memory over `num_stages` steps.
  fma  acc[BM, BN, BK] += x[BM, 1, BK] * w[1, BN, BK], reduced over K once after the loop, with
       BM = next_power_of_2(M): no padding and no per-step reduction, for M = 1 GEMVs. The
       accumulator lives in registers, so it is limited to `FMA_MAX_ACC_PER_THREAD` floats.

Every size is a runtime argument except the tile shape, so one compile per (tiles, dtype, bias)
serves every layer and every M. No host sync and no allocation besides the output: it can be
captured in a CUDA graph. There is no split-K: it would need a zeroed output or a float32
workspace and a second pass, and with the default tiles N = 4096 already makes 128 programs
(BLOCK_N = 32) or 512 (BLOCK_N = 8, M = 1) for an H100's 132 SMs, measured faster than cuBLAS.

Given `gated` ("silu" or "gelu_tanh"), x is a gated MLP's gate_up [M, 2K] and the kernel's
input is act(gate) * up, made as each K step loads it (kernels.triton_activation.silu_mul,
rounded as silu_and_mul rounds it): the down projection with its activation in one launch, the
product never written out. Every program makes its x tiles so (x is tiny at decode).

Given a LoRA delta (`kernels.lora.LoraDelta`), the epilogue adds each row's adapter to the
program's columns (`kernels.triton_lora.lora_delta`): the expand costs no launch of its own,
which at batch 1 is most of its cost. Its operands are loaded before the weights stream (with
one row all of them; past that all but B, which would hold registers through the loop), so
their latency hides behind it. Past EPILOGUE_MAX_VALUES values of B a tile (larger ranks) the
expand runs after the launch instead.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.invariance import batch_invariant
from kernels.lora import LoraDelta
from kernels.triton_activation import silu_mul
from kernels.triton_lora import check_delta, lora_b, lora_delta, lora_expand, lora_rows
from kernels.triton_pdl import (
    L2_LINE_BYTES,
    launches_early,
    prefetch_to_l2,
    wait_for_previous_kernel,
)
from kernels.triton_stages import launch_fitting

MAX_ROWS = 64  # the most rows this layer takes: past it a GEMM reuses weights enough for cuBLAS
NO_PDL_MAX_ROWS = 16  # the most ops.linear gives it where kernels launch without PDL
DOT_MIN = 16  # tl.dot needs every dimension >= 16
FMA_MAX_ACC_PER_THREAD = 128  # float32 accumulator registers per thread, past which it spills
EPILOGUE_MAX_VALUES = 8192  # a LoRA B tile fused in the epilogue: 64 floats a thread at 4 warps
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GATED = ("silu", "gelu_tanh")  # the activations skinny_linear's gated input takes
# ops.gated_linear fuses the activation up to this many rows. Each program makes the whole x
# (M x K activations) again: at M = 1 some 7M exp for Llama's down projection over 512
# programs, about 2 us of an H100's special-function units beside its 30 us of weight reads.
# Past one row the tl.dot variant makes a [16, BLOCK_K] float32 tile of gate, up and their
# product in registers each step: at 8 rows Gemma-3-12B's decode step took 38.6 ms against
# 8.6 ms with the activation as its own kernel (H200, 2026-12-05), so only one row fuses.
GATED_MAX_ROWS = 1
# The layer shapes default_tiles tells apart at 2-64 rows (8B models, hidden size 4096):
ROUTER_N = 256  # an MoE router: N <= this (too few weight rows for tl.dot's tiles)
NARROW_N = 4096  # o, down: N <= this
WIDE_N = 16384  # gate_up: N >= this; qkv lies between
VOCAB_N = 65536  # lm_head: N >= this
WIDE_K = 8192  # down: K >= this
SMALL_K = 1536  # a small model's layers (SmolLM2-135M: hidden 576, MLP 1536): K <= this


@dataclasses.dataclass(frozen=True)
class LinearTiles:
    """One launch configuration of `skinny_linear`."""

    block_n: int = 32  # output columns (weight rows) per program; a power of two
    block_k: int = 256  # K per loop step; a power of two >= 16
    num_warps: int = 4  # warps per program
    num_stages: int = 4  # software-pipelined loop steps in flight (weight tiles in smem)
    use_dot: bool = True  # tl.dot on a 16/32/64-row tile; False: multiply-add + one reduction

    def __post_init__(self) -> None:
        min_n = DOT_MIN if self.use_dot else 1
        for name, value, low in (
            ("block_n", self.block_n, min_n),
            ("block_k", self.block_k, DOT_MIN),
            ("num_warps", self.num_warps, 1),
        ):
            if value < low or value & (value - 1):
                raise ValueError(f"LinearTiles.{name} must be a power of two >= {low}, got {value}")
        if self.num_stages < 1:
            raise ValueError(f"LinearTiles.num_stages must be >= 1, got {self.num_stages}")

    def rows(self, m: int) -> int:
        """The row tile for M rows: M rounded up to a power of two, at least 16 for tl.dot."""
        rows = triton.next_power_of_2(m)
        return max(DOT_MIN, rows) if self.use_dot else rows

    def acc_per_thread(self, m: int) -> int:
        """float32 accumulator registers per thread (the fma variant keeps [BM, BN, BK])."""
        acc = self.rows(m) * self.block_n * (1 if self.use_dot else self.block_k)
        return triton.cdiv(acc, 32 * self.num_warps)


def default_tiles(m: int, n: int, k: int, dtype: torch.dtype) -> LinearTiles:
    """The configuration for [m, k] x [n, k]^T: sweeps/linear_sweep.py's picks.

    Measured on an H100 (bf16, Triton 3.6, 2026-11-23, `python -m sweeps.linear_sweep`):
    microseconds per call at Llama-3.1-8B shapes, these tiles / cuBLAS (at M = 4 for M >= 2):

        M = 1                  fma n8 k512 w4 s3   qkv 19.3 / 20.9, o 14.0 / 16.3,
                                                   gate_up 78.4 / 81.5, lm_head 337.3 / 374.8,
                                                   down 42.9 / 44.2 (the best, dot: 42.5)
        M >= 2, K >= 8192      dot n32 k512 w4 s4  down 42.8 / 44.2, lm_head 342.1 / 376.1
          or N >= 65536
        M >= 2, the rest       dot n32 k128 w4 s5  qkv 20.0 / 21.0, o 14.5 / 16.3,
                                                   gate_up 82.0 / 81.9

    M = 17..64 since 2026-11-27 (H100, with PDL, `--model qwen3 --m 1 16 32 48 64 --step-m
    32 64`), Qwen3-8B shapes, us per call, these tiles / cuBLAS:
        17-32 rows             qkv (N 4097..16383)  dot n16 k256 w4 s4   20.8 / 21.6
        (x tile of 32)         o, gate_up, down,    dot n32 k512 w4 s4   14.0 / 14.7,
                               lm_head                                   73.8 / 73.8,
                                                                         37.8 / 40.8,
                                                                         419.4 / 444.3
        33-64 rows (x tile of  gate_up, lm_head     dot n128 k128 w8 s3  74.6 / 74.9,
        64: k512 no longer     (N 16384..)                               422.9 / 453.0 at 64
        fits shared memory)    qkv                  dot n64 k128 w4 s4   20.9 / 20.6
                               o, down (N <= 4096)  dot n32 k256 w4 s4   14.2 / 15.0, 38.8 / 42.0
    Llama-3.1-8B at 32 / 48 / 64 rows (2026-11-28, `--m 32 48 64 --step-m 32 64`), these
    tiles / cuBLAS: gate_up (N 28672) 84.9 / 84.2 at 32, 82.5 / 87.3 and 83.1 / 86.6 at 48
    and 64; the others up to 8 % under cuBLAS, but qkv at 64 (20.8 / 20.6). gate_up had
    taken n32 k128 w4 s5 at 17-32 rows and n64 k256 w8 s3 at 33-64 (Qwen3-8B's 72.4 and
    73.4 us), 5 % and 2 % slower than cuBLAS on Llama's gate_up; these are within 1 % of
    cuBLAS on both models, +1.4 and +1.1 us a layer on Qwen3-8B, 4-6 % faster on Llama.
    A step's linear layers with the best tiles per shape: 5.55 against 5.91 ms with cuBLAS at
    32 rows, 5.70 against 5.97 at 64; a whole Qwen3-8B decode step (sweeps/step_mix.py)
    6.81 against 7.20 ms at 32 rows, 7.22 against 7.48 at 64. Before PDL the same tiles gained
    half as much, and one tile for every shape (n32 k256 w4 s4) a fifth (7.11 against 7.19).

    The later picks for one row and for 2-16 rows, with their measurements, are in
    `_tiles_one_row` and `_tiles_16_rows`, those for a small model's short K in
    `_tiles_small_k`; `_fit_block_k` fits the K step to float32 and to K.
    """
    # --batch-invariant: one row takes the tiles of 2-16, so a row's sums are the same at any
    # of those row counts (kernels/invariance.py).
    one_row = m == 1 and not batch_invariant(m)
    if k <= SMALL_K and m <= 16:
        tiles = _tiles_small_k(one_row, n, k)
    elif one_row:
        tiles = _tiles_one_row(n, k)
    elif m > 32:  # x tiles of 64 rows: K steps of 512 no longer fit the shared memory
        tiles = _tiles_64_rows(n)
    elif m > 16:
        tiles = _tiles_32_rows(n, k)
    else:
        tiles = _tiles_16_rows(n, k)
    return _fit_block_k(tiles, k, dtype)


def _tiles_one_row(n: int, k: int) -> LinearTiles:
    """One row (see default_tiles): fma, 8 weight rows a program for a long K or a wide N
    (down, lm_head), 4 for the rest, in K steps of 1024.

    M = 1, K <= 4096: fma n4 k1024 w4 s2 since 2026-11-27 (`--model llama llama-tp2 --m 1`,
    the latter one rank's shapes at --tensor-parallel-size 2), against n8 k512 w4 s3, us per
    call, H100 / H200:
        Llama-3.1-8B        qkv 18.7 / 19.4, 14.8 / 14.9; gate_up 76.8 / 78.4, 57.8 / 59.8;
                            lm_head 332.7 / 337.4, 245.8 / 249.4; o 14.1 / 14.0, 11.8 / 11.5
        one rank of two     qkv 10.6 / 11.6, 8.7 / 10.2; gate_up 40.0 / 42.1, 31.3 / 33.5;
                            lm_head 168.6 / 172.1, 125.4 / 128.2; o (K 2048) 8.1 / 8.1, 7.1 / 7.0
    Fewer weight rows a program and longer K steps keep more bytes in flight where a rank's
    halved N leaves fewer programs.

    M = 1, K > 4096 or N >= 32768 (down, lm_head): fma n8 k1024 w4 s2 since 2026-11-27 (same
    command, H200, with PDL), against n8 k512 w4 s3 for down and n4 k1024 w4 s2 for lm_head,
    us per call, whole model / one rank of two: down 28.5 / 34.7, 15.6 / 18.8; lm_head 241.4 /
    248.3, 123.9 / 127.5. (o, K <= 4096, would gain 0.5-1.0 us with it; qkv loses 1.6-1.8;
    gate_up, N 28672 and 14336, is within 1 %.)

    Gemma-3-12B (K 3840, o N 3840 K 4096) was tried with n8 for o and the ragged K as well: a
    microsecond a call faster alone, but the whole batch-1 step was 3 % slower (H100,
    2026-12-05, `kvflow bench latency gemma-3-12b`: 9.56 against 9.26 ms), so n4 stays.
    """
    if k > 4096 or n >= 32768:
        return LinearTiles(block_n=8, block_k=1024, num_warps=4, num_stages=2, use_dot=False)
    return LinearTiles(block_n=4, block_k=1024, num_warps=4, num_stages=2, use_dot=False)


def _fit_block_k(tiles: LinearTiles, k: int, dtype: torch.dtype) -> LinearTiles:
    """The tiles with their K step fitted to the dtype and to K.

    float32 (the CPU interpreter, tests) halves block_k, to keep the bytes of a weight tile and
    so the pipelined shared memory the same; block_k never exceeds K rounded up to a power of two.
    """
    block_k = tiles.block_k // 2 if dtype == torch.float32 else tiles.block_k
    block_k = max(DOT_MIN, min(block_k, triton.next_power_of_2(k)))
    return dataclasses.replace(tiles, block_k=block_k)


def _tiles_16_rows(n: int, k: int) -> LinearTiles:
    """2-16 rows (see default_tiles): down, lm_head and o (at most 128 programs of 32 weight
    rows) in K steps of 512; qkv-like N in programs of 16 weight rows; gate_up-like N in
    programs of 32 with K steps of 128.

    M = 2..16 since 2026-11-27 (H100, with PDL, `--model qwen3 --m 2 4 8 16 32 64` and
    `--model llama --m 4 8 16`), us per call at 4 rows, Qwen3-8B and Llama-3.1-8B, these
    tiles / cuBLAS: o (N <= 4096) joins down and lm_head in n32 k512 w4 s4, 13.4 / 16.2 and
    13.4 / 16.3; qkv (N 4097..16383) takes dot n16 k512 w4 s3, 19.3 / 20.8 and 19.3 / 21.0;
    gate_up keeps n32 k128 w4 s5, 70.0 / 72.5 and 81.5 / 82.0 (the models' bests differ: n64
    k128 w4 s4, 68.2, for Qwen3-8B's N 24576; n64 k256 w8 s3, 81.0, for Llama's N 28672).

    An MoE router (N <= ROUTER_N) since 2026-12-06: fma n2 k512 w4 s2. Qwen3-30B-A3B's router
    (N 128, K 2048) at 8 rows took 6.1 us with dot n32 k512 (4 programs), 2.8 with this, 2.7
    with k1024 (H100, `--model qwen3-moe --m 8 16 --step-m 8 16`); K steps of 512 because at
    16 rows 1024 would need 256 accumulator registers a thread, and one K step for 1-16 rows
    keeps --batch-invariant's sums alike. The engine's batch-8 step: 10.997 ms against 11.12
    (`kvflow bench latency Qwen3-30B-A3B`, two rounds alternated). Its o projection (N 2048)
    was also faster alone with dot n16 k256 w4 s4 (9.0 against 10.9 us), but with it the
    engine's step was 0.25 ms slower (11.37 against 11.13), so o keeps n32 k512.
    """
    if n <= ROUTER_N:
        return LinearTiles(block_n=2, block_k=512, num_warps=4, num_stages=2, use_dot=False)
    if k >= WIDE_K or n >= VOCAB_N or n <= NARROW_N:
        return LinearTiles(block_n=32, block_k=512, num_warps=4, num_stages=4)
    if n < WIDE_N:
        return LinearTiles(block_n=16, block_k=512, num_warps=4, num_stages=3)
    return LinearTiles(block_n=32, block_k=128, num_warps=4, num_stages=5)


def _tiles_small_k(one_row: bool, n: int, k: int) -> LinearTiles:
    """1-16 rows with K <= SMALL_K (a small model: every layer is a few microseconds of
    latency, not of bandwidth): K steps of 128 (64 for a vocabulary-wide N), so that a K of
    576 is a pipeline of five steps rather than one and a masked half of 512; one row keeps
    `_tiles_one_row` but for the lm_head.

    Since 2026-12-03 (H200, with PDL, `--model smollm2 --m 1 5 9 16 --step-m 1 9`),
    SmolLM2-135M's shapes, us per call at 9 rows (5 and 16 within 0.2), these tiles / the
    ones before (`_tiles_16_rows`): qkv (N 960, K 576) dot n16 k128 w4 s5 2.4 / 4.1, o (576)
    2.3 / 4.1, down (576, K 1536) 4.0 / 5.3; gate_up (3072) dot n32 k128 w4 s5 3.0 / 4.5;
    lm_head (49152) dot n32 k64 w2 s4 18.2 / 20.0, and 17.3 / 27.1 at one row (fma n8 k1024).
    A step's linear layers at 9 rows (a row verifying 8 drafts): 0.360 against 0.537 ms.
    Qwen3-0.6B (`--model qwen3-0.6b`, K 1024 but for o and down) gains too: the lm_head at 9
    rows 80.8 against 146.8 us, at one 76.8 against 85.4 (docs/benchmarks.md).
    """
    if n >= 32768:
        return LinearTiles(block_n=32, block_k=64, num_warps=2, num_stages=4)
    if one_row:
        return _tiles_one_row(n, k)
    if n >= 2048:
        return LinearTiles(block_n=32, block_k=128, num_warps=4, num_stages=5)
    return LinearTiles(block_n=16, block_k=128, num_warps=4, num_stages=5)


def _tiles_32_rows(n: int, k: int) -> LinearTiles:
    """17-32 rows (see default_tiles): qkv-like N in programs of 16 weight rows (N = 6144
    makes 384 programs, against 192 for 1.45 waves of 132 SMs at 32), the rest (o, gate_up,
    down, lm_head) in programs of 32 weight rows with K steps of 512."""
    if NARROW_N < n < WIDE_N and k < WIDE_K:
        return LinearTiles(block_n=16, block_k=256, num_warps=4, num_stages=4)
    return LinearTiles(block_n=32, block_k=512, num_warps=4, num_stages=4)


def _tiles_64_rows(n: int) -> LinearTiles:
    """33-64 rows (see default_tiles), weight rows a program: gate_up- and lm_head-like N
    128 over 8 warps; qkv 64; o and down 32."""
    if n >= WIDE_N:
        return LinearTiles(block_n=128, block_k=128, num_warps=8, num_stages=3)
    if n > NARROW_N:
        return LinearTiles(block_n=64, block_k=128, num_warps=4, num_stages=4)
    return LinearTiles(block_n=32, block_k=256, num_warps=4, num_stages=4)


def skinny_max_rows(x: torch.Tensor) -> int:
    """The most rows `kernels.ops.linear` gives this kernel rather than cuBLAS: all it takes
    where kernels launch with PDL (Hopper on, --disable-pdl off), whose early launch and L2
    prefetch put the tiles 6 % ahead of cuBLAS at 32 rows (3 % without it, in an earlier
    sweep); elsewhere 16, also because the 17-64-row tiles were swept on Hopper only (K steps
    of 512 over 32 rows take more shared memory than an A100 has)."""
    return MAX_ROWS if launches_early(x) else NO_PDL_MAX_ROWS


# NOTE: m is not specialised, so M = 1 (Triton's "== 1" case) and M = 16 ("divisible by 16")
# share the compile of the other M of their row tile. n, k and the strides are: K % 16 == 0 lets
# the weight loads be 16-byte vectors.
@triton.jit(do_not_specialize=["m"])
def _skinny_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N]; any pointer when not HAS_BIAS
    out_ptr,  # [M, N]
    m,
    n,
    k,
    stride_x_row,
    stride_w_row,
    stride_out_row,
    lora_y_ptr,  # [KS, M, P, R] float32 with HAS_LORA (LoraDelta.shrunk); any pointer otherwise
    lora_b_ptr,  # [S, N, R]
    lora_slots_ptr,  # [M] int32
    lora_num_slots,
    lora_num_splits,
    lora_piece_start_1,  # the first column of piece 1 (n if none)
    lora_piece_start_2,
    lora_stride_y_split,
    lora_stride_y_row,
    lora_stride_y_piece,
    lora_stride_b_slot,
    lora_stride_b_row,
    BLOCK_M: tl.constexpr,  # next_power_of_2(M), at least 16 with USE_DOT
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,  # under TRITON_INTERPRET: see UPCAST below
    HAS_LORA: tl.constexpr,  # add each row's LoRA adapter (BLOCK_N divides every piece)
    LORA_RANK: tl.constexpr,
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
    PREFETCH_LINES: tl.constexpr,  # with PDL: the 128-byte lines of its first weight tile a row
    LINE_ELEMENTS: tl.constexpr,  # weight elements in a line
    GATED: tl.constexpr,  # x_ptr is a gate_up's gate half: the input is act(gate) * up
    GELU: tl.constexpr,  # with GATED: gelu_tanh(gate) rather than silu(gate)
):
    rows = tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    ks = tl.arange(0, BLOCK_K)  # [BK]
    row_valid = rows < m
    col_valid = cols < n
    if PREFETCH_LINES > 0:  # into L2 while the previous kernel ends (safe: kernels.triton_pdl)
        lines = tl.minimum(tl.arange(0, PREFETCH_LINES) * LINE_ELEMENTS, k - 1)
        first = tl.minimum(cols, n - 1).to(tl.int64)[:, None] * stride_w_row + lines[None, :]
        prefetch_to_l2(w_ptr + first)
    wait_for_previous_kernel(PDL)
    if HAS_LORA:  # loaded before the weights stream, so their latency hides behind it
        slots, adapted, lora_y = lora_rows(
            lora_y_ptr, lora_slots_ptr, rows, row_valid, tl.program_id(0) * BLOCK_N,
            lora_num_slots, lora_num_splits, lora_piece_start_1, lora_piece_start_2,
            lora_stride_y_split, lora_stride_y_row, lora_stride_y_piece, LORA_RANK,
        )  # fmt: skip
        if not USE_DOT:  # one row: its few B values too
            b = lora_b(
                lora_b_ptr, slots, adapted, cols, col_valid, lora_stride_b_slot, lora_stride_b_row,
                LORA_RANK,
            )  # fmt: skip
    x_ptrs = x_ptr + rows[:, None] * stride_x_row + ks[None, :]  # [BM, BK]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_w_row + ks[None, :]  # [BN, BK]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)

    for k_start in range(0, k, BLOCK_K):
        # When K % BLOCK_K == 0 the mask is a constant: no per-element predicate on the loads.
        k_valid = tl.full([BLOCK_K], True, tl.int1) if EVEN_K else k_start + ks < k  # [BK]
        x_mask = row_valid[:, None] & k_valid[None, :]
        if GATED:  # up lies K columns past gate in gate_up's rows
            x = silu_mul(x_ptrs, x_mask, k, x_ptr.dtype.element_ty, GELU)  # [BM, BK]
        else:
            x = tl.load(x_ptrs, mask=x_mask, other=0.0)  # [BM, BK]
        w = tl.load(w_ptrs, mask=col_valid[:, None] & k_valid[None, :], other=0.0)  # [BN, BK]
        if USE_DOT and INTERPRETED:  # the interpreter's tl.dot is wrong for bf16 (see UPCAST)
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        elif USE_DOT:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)  # [BM, BN]
        else:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BM, BN, BK]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if not USE_DOT:
        acc = tl.sum(acc, axis=2)  # [BM, BN]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    if HAS_LORA:
        if USE_DOT:  # 16 rows or more: B [BM, BN, R] is read here, not held through the loop
            b = lora_b(
                lora_b_ptr, slots, adapted, cols, col_valid, lora_stride_b_slot, lora_stride_b_row,
                LORA_RANK,
            )  # fmt: skip
        acc += lora_delta(lora_y, b)
    out_ptrs = out_ptr + rows[:, None] * stride_out_row + cols[None, :]  # [BM, BN]
    out_mask = row_valid[:, None] & col_valid[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be 2-D")
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"skinny_linear takes 1 to {MAX_ROWS} rows, got {m}")
    if x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} must be [M, K] for weight [N={n}, K={k}]")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight need one dtype of {DTYPES}, got {x.dtype}, {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous in their last (K) dimension")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight on {weight.device}")
    if bias is None:
        return
    if bias.shape != (n,) or bias.stride(0) != 1 or bias.dtype != x.dtype:
        raise ValueError(f"bias must be a contiguous [{n}] {x.dtype}, got {tuple(bias.shape)}")
    if bias.device != x.device:
        raise ValueError(f"bias is on {bias.device} but x on {x.device}")


def skinny_linear(
    x: torch.Tensor,  # [M, K], 1 <= M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K], nn.Linear layout; rows may be strided
    bias: torch.Tensor | None = None,  # [N]
    *,
    tiles: LinearTiles | None = None,  # None: default_tiles(M, N, K, dtype)
    lora: LoraDelta | None = None,  # each row's LoRA adapter, added in the epilogue
    gated: str | None = None,  # GATED: x is gate_up [M, 2K], the input act(gate) * up
) -> torch.Tensor:  # [M, N], x.dtype, new and contiguous
    """x @ weight.T + bias (+ the LoRA delta) for decode-sized M."""
    if gated is not None:
        if gated not in GATED or lora is not None or x.dim() != 2 or x.shape[1] % 2:
            raise ValueError(
                f"gated: one of {GATED} on a [M, 2K] gate_up, without LoRA (got {gated},"
                f" x {tuple(x.shape)})"
            )
        x = x[:, : x.shape[1] // 2]  # the gate half; up follows it in each row
    _check_inputs(x, weight, bias)
    m, (n, k) = x.shape[0], weight.shape
    tiles = tiles or default_tiles(m, n, k, x.dtype)
    if tiles.acc_per_thread(m) > FMA_MAX_ACC_PER_THREAD:
        raise ValueError(
            f"{tiles} at M={m} needs {tiles.acc_per_thread(m)} accumulator registers per thread"
            f" (at most {FMA_MAX_ACC_PER_THREAD}): use smaller tiles, more warps or tl.dot"
        )
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    if n == 0:
        return out
    fused = lora is not None and _fuses(lora, tiles, m)
    _launch_skinny_linear(x, weight, bias, out, tiles, lora if fused else None, gated)
    if lora is not None and not fused:
        lora_expand(out, *lora)
    return out


def _fuses(lora: LoraDelta, tiles: LinearTiles, m: int) -> bool:
    """Whether the epilogue can add the delta: every column block within one piece, and B's
    tile [rows, block_n, rank] small enough to stay in registers."""
    within_pieces = all(rows % tiles.block_n == 0 for rows in lora.piece_rows)
    b_values = tiles.rows(m) * tiles.block_n * lora.lora_b.shape[2]
    return within_pieces and b_values <= EPILOGUE_MAX_VALUES


def _launch_skinny_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    out: torch.Tensor,  # [M, N], written
    tiles: LinearTiles,
    lora: LoraDelta | None = None,  # whose pieces' rows tiles.block_n divides
    gated: str | None = None,  # x is a gate_up's gate half (skinny_linear)
) -> None:
    """One launch of the kernel over checked inputs."""
    m, (n, k) = x.shape[0], weight.shape
    lora_args = _lora_arguments(lora, n, m) if lora is not None else [weight, weight, weight]
    lora_args += [0] * (12 - len(lora_args))
    early = launches_early(x)
    block_m = tiles.rows(m)
    grid = (triton.cdiv(n, tiles.block_n),)
    args = (
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        *lora_args,
    )
    constants = dict(
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        USE_DOT=tiles.use_dot,
        HAS_BIAS=bias is not None,
        EVEN_K=k % tiles.block_k == 0,
        # Read for float32 operands only.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        # UPCAST: off CUDA the kernel can only run under TRITON_INTERPRET, whose tl.dot multiplies
        # bfloat16 as raw uint16 bits (Triton 3.9), so the tiles go to float32 first: exact, as a
        # product of two 8-bit mantissas fits in 24 bits, and tensor cores accumulate in float32.
        INTERPRETED=not x.is_cuda,
        HAS_LORA=lora is not None,
        LORA_RANK=lora.lora_b.shape[2] if lora is not None else 16,
        PDL=early,
        PREFETCH_LINES=triton.cdiv(tiles.block_k * weight.element_size(), L2_LINE_BYTES)
        if early
        else 0,
        LINE_ELEMENTS=L2_LINE_BYTES // weight.element_size(),
        GATED=gated is not None,
        GELU=gated == "gelu_tanh",
        num_warps=tiles.num_warps,
        launch_pdl=early,
    )
    variant = ("skinny_linear", x.device, x.dtype, weight.dtype, *constants.values())
    launch_fitting(
        variant,
        tiles.num_stages,
        lambda stages: _skinny_linear_kernel[grid](*args, **constants, num_stages=stages),
    )


def _lora_arguments(lora: LoraDelta, n: int, m: int) -> list[object]:
    """The kernel's LoRA arguments, checked as lora_expand checks them."""
    shrunk, lora_b, token_slots, piece_rows, _ = lora  # rows are read in place: no order
    starts = check_delta(m, n, shrunk, lora_b, token_slots, piece_rows)
    return [
        shrunk, lora_b, token_slots, lora_b.shape[0], shrunk.shape[0], *starts,
        shrunk.stride(0), shrunk.stride(1), shrunk.stride(2), lora_b.stride(0), lora_b.stride(1),
    ]  # fmt: skip
