"""RMSNorm, plain and fused with the residual add (and with a norm of the added row before it)."""

from __future__ import annotations

import torch

from kernels.fp8 import Fp8Rows


def rms_norm_reference(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden]
    # Computed in float32 and cast back, as the reference models do.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm_pair_reference(
    a: torch.Tensor,  # [num_tokens, hidden]
    a_weight: torch.Tensor,  # [hidden]
    b: torch.Tensor,  # [num_tokens, hidden]
    b_weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [num_tokens, 2 * hidden]
    """a's norm and b's side by side (an EAGLE-3 layer's input: its token and hidden state)."""
    return torch.cat(
        [rms_norm_reference(a, a_weight, eps), rms_norm_reference(b, b_weight, eps)], -1
    )


def fused_add_rms_norm_reference(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual = x + residual)
    residual = x + residual
    return rms_norm_reference(residual, weight, eps), residual


def fused_norm_add_rms_norm_reference(
    x: torch.Tensor,  # [num_tokens, hidden]: a sublayer's output
    residual: torch.Tensor,  # [num_tokens, hidden]
    x_weight: torch.Tensor,  # [hidden]: x's own norm (Gemma's norm after a sublayer)
    weight: torch.Tensor,  # [hidden]: the sum's norm (the next sublayer's, before it)
    eps: float,  # both norms'
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual = rms_norm(x) + residual)
    """Gemma's two norms between sublayers: x normed, added to the residual stream, the sum
    normed for the next sublayer."""
    return fused_add_rms_norm_reference(rms_norm_reference(x, x_weight, eps), residual, weight, eps)


def rms_norm_fp8_reference(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    static_scale: torch.Tensor | None = None,  # [1]: the layer's; None: per token
) -> Fp8Rows:  # the normed rows, rounded to their dtype, then quantized
    """RMSNorm feeding an FP8 layer: the same values as the norm followed by the layer's own
    quantization."""
    return Fp8Rows.quantize(rms_norm_reference(x, weight, eps), static_scale)


def fused_add_rms_norm_fp8_reference(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    static_scale: torch.Tensor | None = None,  # [1]: the layer's; None: per token
) -> tuple[Fp8Rows, torch.Tensor]:  # (normed and quantized, new residual)
    normed, residual = fused_add_rms_norm_reference(x, residual, weight, eps)
    return Fp8Rows.quantize(normed, static_scale), residual
