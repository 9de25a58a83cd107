"""SiLU-and-mul, the gated MLP's activation, in Triton, and GELU-and-mul (GeGLU: `GELU`, the
tanh approximation, Gemma's) by the same kernels.

Same math as `kernels.activation`: [T, 2I] -> [T, I], silu(gate) * up with gate = the first I
columns and up = the last I. Fused so that the [T, 2I] projection is read once and only the
[T, I] product is written, where torch materialises silu(gate) in between. The math is float32,
rounded once to the input dtype (the reference rounds silu(gate) first, so bf16 differs by about
an ulp).

`silu_and_mul_fp8` feeds an FP8 down projection (`kernels.fp8.Fp8Rows`): one program per row
quantizes the product per token, rounded to its dtype as `silu_and_mul` stores it, so the
layer's own quantization pass disappears. Rows up to FP8_BLOCK columns (Llama-3-8B's 14,336,
Qwen3-8B's 12,288) are read once and held in registers; longer rows are computed twice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8, MIN_SCALE, Fp8Rows, check_static_scale
from kernels.triton_e4m3 import scale_for, to_e4m3
from kernels.triton_pdl import launches_early, wait_for_previous_kernel

_BLOCK = 1024  # columns per program at most
FP8_BLOCK = 16384  # columns of a row in registers in the FP8 variant: 16 floats a thread


@triton.jit
def silu_mul(gate_ptrs, mask, inter, OUT_DTYPE: tl.constexpr, GELU: tl.constexpr):
    """silu(gate) * up at gate_ptrs (up lies `inter` further), in float32 rounded to OUT_DTYPE;
    with GELU, gelu_tanh(gate) * up. (Also the skinny GEMV's input: kernels/triton_linear.py.)"""
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(y)), tanh(y) = 1 - 2 / (exp(2y) + 1): +-1 where exp saturates
        y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        out = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * up
    else:
        out = gate / (1.0 + tl.exp(-gate)) * up  # exp overflows to inf for gate << 0: -> -0
    return out.to(OUT_DTYPE)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2I]
    out_ptr,  # [T, I]; float8e4nv with STATIC_FP8
    static_scale_ptr,  # [1] float32 with STATIC_FP8
    scale_ptr,  # [T] float32 with STATIC_FP8: each row's scale (the static one)
    stride_in_row,
    stride_out_row,
    inter,
    BLOCK: tl.constexpr,
    STATIC_FP8: tl.constexpr,  # quantized by a static scale: no row maximum, so any tiling
    GELU: tl.constexpr,  # gelu_tanh(gate) instead of silu(gate)
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    in_ptrs = gate_up_ptr + row * stride_in_row + cols
    out = silu_mul(in_ptrs, mask, inter, gate_up_ptr.dtype.element_ty, GELU)
    if STATIC_FP8:
        scale = tl.load(static_scale_ptr)
        out = to_e4m3(out.to(tl.float32) / scale)
        if tl.program_id(1) == 0:
            tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    gate_up_ptr,  # [T, 2I]
    q_ptr,  # [T, I] float8e4nv
    scale_ptr,  # [T] float32
    stride_in_row,
    stride_q_row,
    inter,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,  # inter <= BLOCK (a constant, so only one branch is compiled)
    GELU: tl.constexpr,  # gelu_tanh(gate) instead of silu(gate)
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    gate_ptrs = gate_up_ptr + row * stride_in_row + cols
    q_ptrs = q_ptr + row * stride_q_row + cols
    dtype = gate_up_ptr.dtype.element_ty
    if ONE_BLOCK:  # the row in registers: read once
        out = silu_mul(gate_ptrs, cols < inter, inter, dtype, GELU).to(tl.float32)
        scale = scale_for(tl.max(tl.abs(out), axis=0))
        tl.store(q_ptrs, to_e4m3(out / scale).to(q_ptr.dtype.element_ty), mask=cols < inter)
    else:  # pass 1: the row's absolute maximum; pass 2: the product again, quantized
        amax = tl.zeros([BLOCK], tl.float32)
        for start in range(0, inter, BLOCK):
            out = silu_mul(gate_ptrs + start, start + cols < inter, inter, dtype, GELU)
            amax = tl.maximum(amax, tl.abs(out.to(tl.float32)))
        scale = scale_for(tl.max(amax, axis=0))
        for start in range(0, inter, BLOCK):
            mask = start + cols < inter
            out = silu_mul(gate_ptrs + start, mask, inter, dtype, GELU).to(tl.float32)
            tl.store(q_ptrs + start, to_e4m3(out / scale).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * inter] -> [..., inter] (new, contiguous): gelu_tanh(gate) * up."""
    return silu_and_mul(gate_up, gelu=True)


def gelu_tanh_and_mul_fp8(
    gate_up: torch.Tensor, static_scale: torch.Tensor | None = None
) -> Fp8Rows:
    """`kernels.activation.gelu_tanh_and_mul_fp8_reference`, as silu_and_mul_fp8."""
    return silu_and_mul_fp8(gate_up, static_scale, gelu=True)


def silu_and_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """[..., 2 * inter] -> [..., inter] (new, contiguous): silu(gate) * up (`gelu`:
    gelu_tanh(gate) * up)."""
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} needs an even last dim")
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    rows = _as_rows(gate_up)  # [N, 2I]
    num_rows = rows.shape[0]
    if num_rows == 0 or inter == 0:
        return out
    _launch_tiled(rows, out.view(num_rows, inter), inter, None, None, gelu)
    return out


def _launch_tiled(
    rows: torch.Tensor,  # [T, 2I]
    out: torch.Tensor,  # [T, I]
    inter: int,
    static_scale: torch.Tensor | None,  # [1]: quantize `out` by it (FP8)
    scale: torch.Tensor | None,  # [T, 1]: written with static_scale
    gelu: bool,
) -> None:
    block = min(triton.next_power_of_2(inter), _BLOCK)
    grid = (rows.shape[0], triton.cdiv(inter, block))
    early = launches_early(rows)
    _silu_and_mul_kernel[grid](
        rows,
        out,
        static_scale if static_scale is not None else rows,  # read only with STATIC_FP8
        scale if scale is not None else rows,
        rows.stride(0),
        out.stride(0),
        inter,
        BLOCK=block,
        STATIC_FP8=static_scale is not None,
        GELU=gelu,
        PDL=early,
        num_warps=min(max(block // 256, 1), 4),
        launch_pdl=early,
    )


def silu_and_mul_fp8(
    gate_up: torch.Tensor,  # [T, 2 * inter]
    static_scale: torch.Tensor | None = None,  # [1] float32: the layer's; None: per token
    gelu: bool = False,  # gelu_tanh(gate) * up
) -> Fp8Rows:
    """`kernels.activation.silu_and_mul_fp8_reference`: [T, 2 * inter] -> the product [T, inter]
    quantized per token (one program a row), or by the static scale (tiled as the plain
    kernel), in one pass."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must be 2-D with an even last dim")
    check_static_scale(static_scale)
    rows = _as_rows(gate_up)
    num_rows, inter = rows.shape[0], rows.shape[1] // 2
    q = torch.empty((num_rows, inter), dtype=FP8, device=gate_up.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=gate_up.device)
    if not inter:  # no values: the scale of zeros
        scale.fill_(MIN_SCALE)
    if num_rows and inter and static_scale is not None:
        _launch_tiled(rows, q, inter, static_scale, scale, gelu)
    elif num_rows and inter:
        block = min(triton.next_power_of_2(inter), FP8_BLOCK)
        early = launches_early(rows)
        _silu_and_mul_fp8_kernel[(num_rows,)](
            rows, q, scale, rows.stride(0), q.stride(0), inter,
            BLOCK=block,
            ONE_BLOCK=inter <= block, GELU=gelu, PDL=early,
            num_warps=min(max(block // 512, 1), 32), launch_pdl=early,
        )  # fmt: skip
    return Fp8Rows(q, scale, gate_up.dtype)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, 2I] with a row stride and contiguous columns; copies only for layouts with none."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1])  # NOTE: a copy, only for odd leading dims
