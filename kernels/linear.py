"""A linear layer: the torch reference that `kernels.triton_linear` is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_reference(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K], nn.Linear layout
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x.dtype
    """x @ weight.T + bias."""
    return F.linear(x, weight, bias)
