"""Greedy sampling's reduction: the index of each row's largest logit."""

from __future__ import annotations

import torch


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:  # [R] int64
    """logits [R, V] -> the first index of each row's maximum, as torch.argmax."""
    return logits.argmax(dim=-1)
