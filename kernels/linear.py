"""A linear layer, optionally fed by the gated MLP's SiLU-and-mul (the down projection's input)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul_reference


def linear_reference(
    x: torch.Tensor,  # [M, K], or [M, 2K] (gate | up) when gated
    weight: torch.Tensor,  # [N, K], nn.Linear layout
    bias: torch.Tensor | None = None,  # [N]
    *,
    gated: bool = False,
) -> torch.Tensor:  # [M, N], x.dtype
    """x @ weight.T + bias; with `gated`, silu(gate) * up (in x.dtype) takes the place of x."""
    if gated:
        x = silu_and_mul_reference(x)  # [M, K]
    return F.linear(x, weight, bias)
