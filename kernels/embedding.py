"""The embedding lookup of a rank that holds some of the vocabulary's rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def embedding_rows_reference(
    ids: torch.Tensor,  # [T] token ids, integer
    weight: torch.Tensor,  # [rows, hidden]: the vocabulary's rows first_id .. first_id + rows - 1
    first_id: int,
) -> torch.Tensor:  # [T, hidden]
    """Each id's row of `weight` where it holds the id, zeros where it does not: with tensor
    parallelism, the ranks' results added up are the whole model's embedding."""
    local = ids - first_id
    held = (local >= 0) & (local < weight.shape[0])
    rows = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    return rows.masked_fill(~held[:, None], 0)
