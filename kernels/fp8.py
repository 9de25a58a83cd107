"""FP8 (e4m3) W8A8 linear layers: the torch references.

Weights are quantized once, per output channel (a scale per row of [N, K]); activations per
token (a scale per row of [M, K]) at every call, from their absolute maximum. The product is
the float product of the dequantized operands, so the reference is exact up to the float32
sum's order, and any faster path (cuBLASLt's `_scaled_mm`, a Triton kernel) is checked
against it.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# A row of zeros still gets a usable scale (any tiny positive value: 0 / scale stays 0).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_fp8_rowwise_reference(
    x: torch.Tensor,  # [R, C]
) -> tuple[torch.Tensor, torch.Tensor]:  # ([R, C] float8_e4m3fn, [R, 1] float32)
    """Each row scaled into e4m3's range by its absolute maximum: x ≈ q * scale."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def fp8_linear_reference(
    x: torch.Tensor,  # [M, K], bf16/fp16/fp32
    qweight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x.dtype
    """x quantized per token, times the dequantized weight, in float32."""
    qx, x_scale = quantize_fp8_rowwise_reference(x)
    out = (qx.float() @ qweight.float().t()) * x_scale * weight_scale[None, :]  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
