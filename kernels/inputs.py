"""Input token ids that only the device knows yet: the tokens of the step still in flight."""

from __future__ import annotations

import torch


def gather_sampled_inputs_reference(
    input_ids: torch.Tensor,  # [num_tokens] int32, updated in place
    source_rows: torch.Tensor,  # [num_tokens] int32: row of sampled_ids to take, or -1
    sampled_ids: torch.Tensor,  # [max_reqs] int64: the last step's sampled token ids
) -> None:
    """input_ids[t] = sampled_ids[source_rows[t]] where source_rows[t] >= 0; no host sync."""
    take = source_rows >= 0  # [T]
    gathered = sampled_ids[source_rows.clamp(min=0).long()].to(input_ids.dtype)  # [T]
    input_ids.copy_(torch.where(take, gathered, input_ids))
