"""SiLU-and-mul, the gated MLP's activation, and GELU-and-mul (GeGLU, Gemma's: the tanh
approximation of GELU, transformers' gelu_pytorch_tanh)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import Fp8Rows


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * inter] -> [num_tokens, inter]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * inter] -> [num_tokens, inter]: gelu_tanh(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul_fp8_reference(
    gate_up: torch.Tensor, static_scale: torch.Tensor | None = None
) -> Fp8Rows:
    """GELU-and-mul feeding an FP8 layer, as silu_and_mul_fp8_reference."""
    return Fp8Rows.quantize(gelu_tanh_and_mul_reference(gate_up), static_scale)


def silu_and_mul_fp8_reference(
    gate_up: torch.Tensor,  # [num_tokens, 2 * inter]
    static_scale: torch.Tensor | None = None,  # [1]: the layer's; None: per token
) -> Fp8Rows:
    """SiLU-and-mul feeding an FP8 layer: the product quantized as the layer itself would."""
    return Fp8Rows.quantize(silu_and_mul_reference(gate_up), static_scale)
