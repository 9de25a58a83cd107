"""The LoRA tensors a linear layer reads: each token's adapter slot, and a projection's slots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class LoraTokens(NamedTuple):
    """A step's tokens as LoRA sees them: each token's slot, and the tokens grouped by slot."""

    slots: torch.Tensor  # [T] int32, -1: the base model
    order: torch.Tensor  # [T] int32, a permutation of the tokens, sorted by slot


@dataclass(frozen=True)
class ProjectionSlots:
    lora_a: torch.Tensor  # [S, P, R, K]
    lora_b: torch.Tensor  # [S, N, R], times each adapter's scaling
    piece_rows: tuple[int, ...]  # output rows of each piece
