"""RMSNorm in Triton, plain and fused with the residual add.

Same math as `kernels.norm`: the mean square in float32, and the normalised row cast back to the
input dtype *before* the weight multiply, as the Hugging Face models round, so bf16 and fp16
results match the reference up to the order of the float32 sum.

One program normalises BLOCK_ROWS whole rows held in registers, so each row is read once and
written once. Short rows (Qwen3's per-head q/k norm, head_dim 128) are packed many to a program
so that each program still moves a few KiB.

Rows are addressed as [outer, inner, hidden] with two strides: the q/k views into the fused qkv
output ([T, H, D] with stride(0) = (H + 2 KV) * D) are normalised where they lie, without a copy.

`fused_add_rms_norm` works in place (residual <- x + residual, x <- norm(residual)) because the
decoder drops both inputs right after the call: no allocation, and the sum is normalised while
still in registers instead of being written out and read back. `fused_norm_add_rms_norm` norms
x first (Gemma's norm after a sublayer, then the next one's before it: one launch for two).
`rms_norm_pair` norms two inputs side by side into one row (EAGLE-3's layer input), one launch
where two norms and a concatenation took three.

The `_fp8` variants feed an FP8 layer (`kernels.fp8.Fp8Rows`): the normed row, rounded to its
dtype as the plain kernel stores it, is quantized per token while still in registers, so the
layer's own quantization pass (a launch and a read of the row) disappears.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8, Fp8Rows, check_static_scale
from kernels.invariance import batch_invariant_on
from kernels.triton_e4m3 import scale_for, to_e4m3
from kernels.triton_pdl import launches_early, wait_for_previous_kernel

_TILE_ELEMENTS = 2048  # rows are packed into a program until it holds about this many elements


# NOTE: the row count follows the step's tokens; not specialised (1, a multiple of 16, other),
# a new step size never stops a running server for a compile.
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,  # [outer, inner, hidden]
    residual_ptr,  # [outer, inner, hidden], read and written only when HAS_RESIDUAL
    out_ptr,  # [outer, inner, hidden], may be x_ptr itself; float8e4nv with FP8_OUT
    weight_ptr,  # [hidden]
    x_weight_ptr,  # [hidden] with NORM_X: x's own norm, before the add
    scale_ptr,  # [outer * inner] float32 with FP8_OUT: each row's scale
    static_scale_ptr,  # [1] float32 with STATIC_SCALE: the layer's calibrated scale
    num_rows,  # outer * inner
    inner_rows,  # row r lies at (r // inner_rows, r % inner_rows)
    stride_x_outer,
    stride_x_inner,
    stride_res_outer,
    stride_res_inner,
    stride_out_outer,
    stride_out_inner,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    NORM_X: tl.constexpr,  # x normed (by x_weight) before the add
    FP8_OUT: tl.constexpr,  # quantize each row (e4m3) instead of storing it
    STATIC_SCALE: tl.constexpr,  # by the static scale, not per token
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
):
    wait_for_previous_kernel(PDL)
    rows, cols, col_ok, mask = _row_tile(num_rows, hidden, BLOCK_ROWS, BLOCK_N)
    outer = rows // inner_rows
    inner = rows % inner_rows
    x_offs = (outer * stride_x_outer + inner * stride_x_inner)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)  # [R, N] in x's dtype
    if NORM_X:
        x = _normed(x, x_weight_ptr, cols, col_ok, hidden, eps).to(x_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        res_offs = (outer * stride_res_outer + inner * stride_res_inner)[:, None] + cols[None, :]
        res = tl.load(residual_ptr + res_offs, mask=mask, other=0.0)
        # Rounded to the input dtype before normalising, as the reference's `x + residual`.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptr + res_offs, x, mask=mask)

    out = _normed(x, weight_ptr, cols, col_ok, hidden, eps)
    out_offs = (outer * stride_out_outer + inner * stride_out_inner)[:, None] + cols[None, :]
    if FP8_OUT:
        # As kernels.fp8.quantize_fp8_rowwise_reference on the row the plain kernel stores.
        out = out.to(x_ptr.dtype.element_ty).to(tl.float32)
        if STATIC_SCALE:
            scale = tl.load(static_scale_ptr + rows * 0)  # [R], all the same
        else:
            scale = scale_for(tl.max(tl.abs(out), axis=1))  # [R]
        tl.store(scale_ptr + rows, scale, mask=rows < num_rows)
        out = to_e4m3(out / scale[:, None])
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_tile(num_rows, hidden, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows [R] (int64) and columns [N], the columns within hidden, and the
    [R, N] mask of elements in bounds."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    return rows, cols, col_ok, (rows < num_rows)[:, None] & col_ok[None, :]


@triton.jit
def _normed(x, weight_ptr, cols, col_ok, hidden, eps):
    """Rows x [R, N] normed, rounded to x's dtype (the reference's rounding point), times the
    weight: float32."""
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=1) / hidden + eps)  # [R]; padding columns add 0
    normed = (x32 * rstd[:, None]).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # [N]
    return normed.to(tl.float32) * weight[None, :]


def rms_norm(
    x: torch.Tensor,  # [..., hidden], last dim contiguous
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden], new and contiguous, dtype promote(x, weight) as the reference
    _check_weight(x, weight)
    rows = _as_rows(x)
    if rows is None:
        # NOTE: only layouts no [outer, inner, hidden] view can express are copied; the model's
        # activations and its q/k views never are.
        rows = _as_rows(x.contiguous())
        assert rows is not None  # a contiguous tensor always has the view
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch(rows, None, out.view(rows.shape), weight, eps)
    return out


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_pair_kernel(
    a_ptr,  # [num_rows, hidden]
    a_weight_ptr,  # [hidden]
    b_ptr,  # [num_rows, hidden]
    b_weight_ptr,  # [hidden]
    out_ptr,  # [num_rows, 2 * hidden]: a's norm, then b's
    num_rows,
    stride_a,
    stride_b,
    stride_out,
    hidden,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
):
    wait_for_previous_kernel(PDL)
    rows, cols, col_ok, mask = _row_tile(num_rows, hidden, BLOCK_ROWS, BLOCK_N)
    out_offs = rows[:, None] * stride_out + cols[None, :]
    if tl.program_id(1) == 0:  # the left half
        a = tl.load(a_ptr + rows[:, None] * stride_a + cols[None, :], mask=mask, other=0.0)
        out = _normed(a, a_weight_ptr, cols, col_ok, hidden, eps)
    else:
        b = tl.load(b_ptr + rows[:, None] * stride_b + cols[None, :], mask=mask, other=0.0)
        out = _normed(b, b_weight_ptr, cols, col_ok, hidden, eps)
        out_offs += hidden
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_pair(
    a: torch.Tensor,  # [num_tokens, hidden], rows contiguous
    a_weight: torch.Tensor,  # [hidden]
    b: torch.Tensor,  # [num_tokens, hidden], a's dtype
    b_weight: torch.Tensor,  # [hidden], a_weight's dtype
    eps: float,
) -> torch.Tensor:  # [num_tokens, 2 * hidden]: rms_norm(a) and rms_norm(b) side by side
    """`kernels.norm.rms_norm_pair_reference` in one launch: a program norms its rows of a or of
    b into their half of the output."""
    if a.dim() != 2 or a.shape != b.shape or a.dtype != b.dtype or a_weight.dtype != b_weight.dtype:
        raise ValueError(
            f"a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype}: two 2-D inputs of "
            "one shape and dtype, their weights of one dtype"
        )
    _check_weight(a, a_weight)
    _check_weight(b, b_weight)
    a, b = (t if t.stride(1) == 1 else t.contiguous() for t in (a, b))
    num_rows, hidden = a.shape
    dtype = torch.promote_types(a.dtype, a_weight.dtype)
    out = torch.empty((num_rows, 2 * hidden), dtype=dtype, device=a.device)
    if num_rows == 0:
        return out
    block_rows, block_n, num_warps = _tile_shape(num_rows, hidden)
    early = launches_early(a)
    _rms_norm_pair_kernel[(triton.cdiv(num_rows, block_rows), 2)](
        a,
        a_weight.contiguous(),
        b,
        b_weight.contiguous(),
        out,
        num_rows,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        hidden,
        eps,
        BLOCK_ROWS=block_rows,
        BLOCK_N=block_n,
        PDL=early,
        num_warps=num_warps,
        launch_pdl=early,
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [..., hidden], overwritten with the normed sum
    residual: torch.Tensor,  # [..., hidden], overwritten with x + residual
    weight: torch.Tensor,  # [hidden]
    eps: float,
    x_weight: torch.Tensor | None = None,  # [hidden]: x normed by it first (the one above)
) -> tuple[torch.Tensor, torch.Tensor]:  # (x, residual): the inputs themselves, updated
    """In place: residual <- x + residual, then x <- rms_norm(residual) in x's dtype."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
            f"{residual.dtype} must match in shape and dtype"
        )
    _check_weight(x, weight)
    x_rows, res_rows = _as_rows(x), _as_rows(residual)
    if x_rows is None or res_rows is None:
        # NOTE: odd layouts run on contiguous copies that are copied back, which keeps the
        # in-place contract; the decoder's activations are contiguous, so this path is cold.
        x_copy, res_copy = x.contiguous(), residual.contiguous()
        fused_add_rms_norm(x_copy, res_copy, weight, eps, x_weight)
        return x.copy_(x_copy), residual.copy_(res_copy)
    _launch(x_rows, res_rows, x_rows, weight, eps, x_weight=x_weight)
    return x, residual


def fused_norm_add_rms_norm(
    x: torch.Tensor,  # [..., hidden], overwritten with the normed sum
    residual: torch.Tensor,  # [..., hidden], overwritten with rms_norm(x) + residual
    x_weight: torch.Tensor,  # [hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (x, residual): the inputs themselves, updated
    """In place: residual <- rms_norm(x, x_weight) + residual, then x <- rms_norm(residual)."""
    _check_weight(x, x_weight)
    return fused_add_rms_norm(x, residual, weight, eps, x_weight)


def rms_norm_fp8(
    x: torch.Tensor,  # [num_tokens, hidden], last dim contiguous
    weight: torch.Tensor,  # [hidden], x's dtype
    eps: float,
    static_scale: torch.Tensor | None = None,  # [1] float32: the layer's; None: per token
) -> Fp8Rows:
    """`kernels.norm.rms_norm_fp8_reference`: the norm and the FP8 quantization of the layer it
    feeds, in one pass."""
    _check_fp8_input(x, weight, static_scale)
    out = _empty_rows(x)
    _launch(x.unsqueeze(1), None, out.q.unsqueeze(1), weight, eps, (out.scale, static_scale))
    return out


def fused_add_rms_norm_fp8(
    x: torch.Tensor,  # [num_tokens, hidden], read only
    residual: torch.Tensor,  # [num_tokens, hidden], overwritten with x + residual
    weight: torch.Tensor,  # [hidden], x's dtype
    eps: float,
    static_scale: torch.Tensor | None = None,  # [1] float32: the layer's; None: per token
) -> tuple[Fp8Rows, torch.Tensor]:  # (the normed sum quantized, residual)
    """`kernels.norm.fused_add_rms_norm_fp8_reference`: residual <- x + residual in place, and
    the normed sum quantized for the FP8 layer it feeds; x is not written."""
    _check_fp8_input(x, weight, static_scale)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} "
            f"{x.dtype}, with contiguous rows"
        )
    out = _empty_rows(x)
    scales = (out.scale, static_scale)
    _launch(x.unsqueeze(1), residual.unsqueeze(1), out.q.unsqueeze(1), weight, eps, scales)
    return out, residual


def _check_fp8_input(
    x: torch.Tensor, weight: torch.Tensor, static_scale: torch.Tensor | None
) -> None:
    # Rows of a 2-D activation, rounded to x's dtype before quantizing, as the unfused pair.
    if x.dim() != 2 or x.stride(1) != 1 or weight.dtype != x.dtype:
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype}: 2-D with contiguous rows, weight {weight.dtype} "
            "of the same dtype"
        )
    check_static_scale(static_scale)
    _check_weight(x, weight)


def _empty_rows(x: torch.Tensor) -> Fp8Rows:
    """x's rows quantized, to be written by the kernel."""
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    return Fp8Rows(torch.empty(x.shape, dtype=FP8, device=x.device), scale, x.dtype)


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() == 0 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}")


def _as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """A view [outer, inner, hidden] of `t` with its last dim contiguous, or None if none exists."""
    if t.stride(-1) != 1:
        return None
    if t.dim() <= 2:
        return t.view(-1, 1, t.shape[-1]) if t.dim() == 1 else t.unsqueeze(1)
    try:
        return t.view(-1, t.shape[-2], t.shape[-1])
    except RuntimeError:  # leading dims that no single stride can step through
        return None


def _tile_shape(num_rows: int, hidden: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_N, num_warps): whole rows packed to about _TILE_ELEMENTS a program."""
    block_n = triton.next_power_of_2(hidden)
    block_rows = max(1, _TILE_ELEMENTS // block_n)
    if not batch_invariant_on():  # else one tile shape, so one reduction order, at any count
        block_rows = min(triton.next_power_of_2(num_rows), block_rows)
    # About 16 elements per thread: two 128-bit loads of bf16, enough to hide the latency.
    return block_rows, block_n, min(max(block_rows * block_n // 512, 1), 16)


def _launch(
    x: torch.Tensor,  # [outer, inner, hidden]
    residual: torch.Tensor | None,  # [outer, inner, hidden]
    out: torch.Tensor,  # [outer, inner, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    # quantize into `out` (FP8): the rows' scales [outer * inner] to write, and a static one
    fp8_scales: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    x_weight: torch.Tensor | None = None,  # [hidden]: x normed by it before the add
) -> None:
    outer, inner, hidden = x.shape
    num_rows = outer * inner
    if num_rows == 0:
        return
    block_rows, block_n, num_warps = _tile_shape(num_rows, hidden)
    res = x if residual is None else residual  # never dereferenced without HAS_RESIDUAL
    scale, static = fp8_scales if fp8_scales is not None else (None, None)
    grid = (triton.cdiv(num_rows, block_rows),)
    early = launches_early(x)
    _rms_norm_kernel[grid](
        x,
        res,
        out,
        weight.contiguous(),
        x_weight.contiguous() if x_weight is not None else weight,  # read with NORM_X only
        scale if scale is not None else weight,  # never dereferenced without FP8_OUT
        static if static is not None else weight,  # nor without STATIC_SCALE
        num_rows,
        inner,
        x.stride(0),
        x.stride(1),
        res.stride(0),
        res.stride(1),
        out.stride(0),
        out.stride(1),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        NORM_X=x_weight is not None,
        FP8_OUT=scale is not None,
        STATIC_SCALE=static is not None,
        BLOCK_ROWS=block_rows,
        BLOCK_N=block_n,
        PDL=early,
        num_warps=num_warps,
        launch_pdl=early,
    )
