"""A linear layer: the torch reference that `kernels.triton_linear` is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.lora import LoraDelta, lora_expand_reference


def linear_reference(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K], nn.Linear layout
    bias: torch.Tensor | None = None,  # [N]
    lora: LoraDelta | None = None,  # what each row's LoRA adapter adds
) -> torch.Tensor:  # [M, N], x.dtype
    """x @ weight.T + bias (+ the LoRA delta)."""
    out = F.linear(x, weight, bias)
    return out if lora is None else lora_expand_reference(out, *lora)
