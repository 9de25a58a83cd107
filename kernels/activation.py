"""SiLU-and-mul, the gated MLP's activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import Fp8Rows


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * inter] -> [num_tokens, inter]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_fp8_reference(
    gate_up: torch.Tensor,  # [num_tokens, 2 * inter]
    static_scale: torch.Tensor | None = None,  # [1]: the layer's; None: per token
) -> Fp8Rows:
    """SiLU-and-mul feeding an FP8 layer: the product quantized as the layer itself would."""
    return Fp8Rows.quantize(silu_and_mul_reference(gate_up), static_scale)
