"""SiLU-and-mul, the gated MLP's activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * inter] -> [num_tokens, inter]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
