"""SiLU-and-mul, the gated MLP's activation, in Triton.

Same math as `kernels.activation`: [T, 2I] -> [T, I], silu(gate) * up with gate = the first I
columns and up = the last I. Fused so that the [T, 2I] projection is read once and only the
[T, I] product is written, where torch materialises silu(gate) in between. The math is float32,
rounded once to the input dtype (the reference rounds silu(gate) first, so bf16 differs by about
an ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # columns per program at most


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    stride_in_row,
    stride_out_row,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    gate_ptrs = gate_up_ptr + row * stride_in_row + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up  # exp overflows to inf for gate << 0: silu -> -0
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * inter] -> [..., inter] (new, contiguous): silu(gate) * up."""
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} needs an even last dim")
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    rows = _as_rows(gate_up)  # [N, 2I]
    num_rows = rows.shape[0]
    if num_rows == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), _BLOCK)
    grid = (num_rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        rows,
        out,
        rows.stride(0),
        inter,
        inter,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 4),
    )
    return out


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
