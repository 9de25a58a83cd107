"""Greedy sampling's reduction: the index of each row's largest logit."""

from __future__ import annotations

import torch


def argmax_reference(
    logits: torch.Tensor,  # [R, V]
    offsets: torch.Tensor | None = None,  # [V] int64: added to the index found
    out: torch.Tensor | None = None,  # [R] int64, written
) -> torch.Tensor:  # [R] int64
    """The first index of each row's maximum, as torch.argmax; plus offsets[index] where given
    (an EAGLE-3 head's map from its draft vocabulary into the target's)."""
    index = logits.argmax(dim=-1)
    if offsets is not None:
        index = index + offsets[index]
    if out is None:
        return index
    return out.copy_(index)
