"""A "skinny" linear layer for decode (1 <= M <= 16 rows), in Triton, streaming the weights once.

Same math as `kernels.linear.linear_reference`. At decode batch sizes a linear layer is a
weight-bandwidth problem: each weight is used by at most 16 rows, so the kernel is built to
keep many weight bytes in flight, and nothing else. One program owns BLOCK_N output columns
(BLOCK_N weight rows) and walks K; every program reads the whole (tiny) x:

    weight [N, K], row-major                     x [M, K], rows >= M masked
    +-------------------------------+            +--------------------+
    | program 0: rows 0 .. BN-1     |  --> out[:, 0 .. BN-1]        | reread from L2
    | program 1: rows BN .. 2BN-1   |  --> out[:, BN .. 2BN-1]      | by every program
    | ...   walked in BLOCK_K steps |            +--------------------+
    +-------------------------------+

Two inner products, picked by `LinearTiles.use_dot`:
  dot  acc[16, BN] += x[16, BK] @ w[BN, BK]^T with tl.dot (tensor cores; the x tile is padded to
       16 rows, the minimum of tl.dot, so one compile serves every M). Triton pipelines the
       weight loads into shared memory over `num_stages` steps.
  fma  acc[BM, BN, BK] += x[BM, 1, BK] * w[1, BN, BK], reduced over K once after the loop, with
       BM = next_power_of_2(M): no padding and no per-step reduction, for M = 1 GEMVs. The
       accumulator lives in registers, so it is limited to `FMA_MAX_ACC_PER_THREAD` floats.

With `gated`, x is [M, 2K] (gate | up) and each step computes silu(gate) * up in float32,
rounded once to x.dtype, as `kernels.triton_activation.silu_and_mul` does: the fused layer equals
silu_and_mul followed by this linear, and the [M, K] product is never written.

Every size is a runtime argument except the tile shape, so one compile per (tiles, dtype, gated,
bias) serves every layer and every M. No host sync and no allocation besides the output: it can
be captured in a CUDA graph. There is no split-K: it would need a zeroed output or a float32
workspace and a second pass, and BLOCK_N = 16 already gives N = 4096 two programs per H100 SM.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # the dot variant's row tile, and the most rows this layer takes
DOT_MIN = 16  # tl.dot needs every dimension >= 16
FMA_MAX_ACC_PER_THREAD = 128  # float32 accumulator registers per thread, past which it spills
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class LinearTiles:
    """One launch configuration of `skinny_linear`."""

    block_n: int = 32  # output columns (weight rows) per program; a power of two
    block_k: int = 256  # K per loop step; a power of two >= 16
    num_warps: int = 4  # warps per program
    num_stages: int = 4  # software-pipelined loop steps in flight (weight tiles in smem)
    use_dot: bool = True  # tl.dot on a 16-row tile; False: multiply-add + one reduction

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
        """The row tile for M rows: 16 for tl.dot, else M rounded up to a power of two."""
        return MAX_ROWS if self.use_dot else triton.next_power_of_2(m)

    def acc_per_thread(self, m: int) -> int:
        """float32 accumulator registers per thread (the fma variant keeps [BM, BN, BK])."""
        acc = self.rows(m) * self.block_n * (1 if self.use_dot else self.block_k)
        return triton.cdiv(acc, 32 * self.num_warps)


def default_tiles(m: int, n: int, k: int, dtype: torch.dtype) -> LinearTiles:
    """A configuration for [m, k] x [n, k]^T; to be replaced by benchmarks/linear_sweep.py's picks.

    Narrow programs when N is small, so that N = 4096 still gives 256 programs (two per SM
    on an H100) without split-K; float32 tiles are halved along K to keep the pipelined
    shared memory (num_stages weight tiles) the same size.
    """
    del m  # one row tile serves every M <= 16
    block_n = 16 if n <= 8192 else 32
    block_k = 128 if dtype == torch.float32 else 256
    block_k = max(DOT_MIN, min(block_k, triton.next_power_of_2(k)))
    return LinearTiles(block_n=block_n, block_k=block_k, num_warps=4, num_stages=4)


@triton.jit
def _load_input(x_ptrs, mask, k, GATED: tl.constexpr, LAYOUT_BARRIER: tl.constexpr):
    """The x tile [BM, BK] in x's dtype; with GATED, silu(gate) * up from x [M, 2K]."""
    if GATED:
        gate = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BM, BK]
        up = tl.load(x_ptrs + k, mask=mask, other=0.0).to(tl.float32)  # [BM, BK]
        # Same formula as triton_activation: exp overflows to inf for gate << 0, silu -> -0.
        x = gate / (1.0 + tl.exp(-gate)) * up  # [BM, BK] float32
        if LAYOUT_BARRIER:
            # NOTE: an opaque copy that Triton cannot see through. Without it, Triton moves the
            # conversion to tl.dot's operand layout above the math, where every warp holds the
            # whole x tile, so each warp computes silu on all 16 x BK elements: num_warps times
            # the work (SASS for sm_90: 256 MUFU per thread per BK=256 step instead of 64, an
            # MUFU-bound loop). With it, each element is computed once and the product goes
            # through shared memory into the dot layout.
            x = tl.inline_asm_elementwise(
                "mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1
            )
        x = x.to(x_ptrs.dtype.element_ty)
    else:
        x = tl.load(x_ptrs, mask=mask, other=0.0)  # [BM, BK]
    return x


# NOTE: m is not specialised, so M = 1 (Triton's "== 1" case) and M = 16 ("divisible by 16")
# share the compile of every other M. n, k and the strides are: K % 16 == 0 lets the weight
# loads be 16-byte vectors.
@triton.jit(do_not_specialize=["m"])
def _skinny_linear_kernel(
    x_ptr,  # [M, K], or [M, 2K] (gate | up) when GATED
    w_ptr,  # [N, K]
    bias_ptr,  # [N]; any pointer when not HAS_BIAS
    out_ptr,  # [M, N]
    m,
    n,
    k,
    stride_x_row,
    stride_w_row,
    stride_out_row,
    BLOCK_M: tl.constexpr,  # 16 with USE_DOT, else next_power_of_2(M)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,  # under TRITON_INTERPRET: no inline asm, and see UPCAST below
):
    rows = tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    ks = tl.arange(0, BLOCK_K)  # [BK]
    row_valid = rows < m
    col_valid = cols < n
    x_ptrs = x_ptr + rows[:, None] * stride_x_row + ks[None, :]  # [BM, BK]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_w_row + ks[None, :]  # [BN, BK]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)

    for k_start in range(0, k, BLOCK_K):
        # When K % BLOCK_K == 0 the mask is a constant: no per-element predicate on the loads.
        k_valid = tl.full([BLOCK_K], True, tl.int1) if EVEN_K else k_start + ks < k  # [BK]
        x_mask = row_valid[:, None] & k_valid[None, :]  # [BM, BK]
        x = _load_input(x_ptrs, x_mask, k, GATED, USE_DOT and not INTERPRETED)  # [BM, BK]
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
    out_ptrs = out_ptr + rows[:, None] * stride_out_row + cols[None, :]  # [BM, BN]
    out_mask = row_valid[:, None] & col_valid[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _check_inputs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool
) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be 2-D")
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"skinny_linear takes 1 to {MAX_ROWS} rows, got {m}")
    expected_k = 2 * k if gated else k
    if x.shape[1] != expected_k:
        layout = "[M, 2K] (gate | up)" if gated else "[M, K]"
        raise ValueError(f"x {tuple(x.shape)} must be {layout} for weight [N={n}, K={k}]")
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
    x: torch.Tensor,  # [M, K], or [M, 2K] (gate | up) when gated; 1 <= M <= 16
    weight: torch.Tensor,  # [N, K], nn.Linear layout; rows may be strided
    bias: torch.Tensor | None = None,  # [N]
    *,
    gated: bool = False,
    tiles: LinearTiles | None = None,  # None: default_tiles(M, N, K, dtype)
) -> torch.Tensor:  # [M, N], x.dtype, new and contiguous
    """x @ weight.T + bias for decode-sized M; with `gated`, silu(gate) * up takes x's place."""
    _check_inputs(x, weight, bias, gated)
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
    _skinny_linear_kernel[(triton.cdiv(n, tiles.block_n),)](
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
        BLOCK_M=tiles.rows(m),
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        USE_DOT=tiles.use_dot,
        GATED=gated,
        HAS_BIAS=bias is not None,
        EVEN_K=k % tiles.block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        # UPCAST: off CUDA the kernel can only run under TRITON_INTERPRET, whose tl.dot multiplies
        # bfloat16 as raw uint16 bits (Triton 3.9), so the tiles go to float32 first: exact, as a
        # product of two 8-bit mantissas fits in 24 bits, and tensor cores accumulate in float32.
        INTERPRETED=not x.is_cuda,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
