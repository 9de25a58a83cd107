"""Per-step tensors that tell attention where each request's tokens and context live."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int: cache slot each new token is written to
    # [num_reqs, max_blocks] int32; entries past a request's blocks are never read (stale, 0,
    # or -1 where EAGLE-3's draft passes mark a row's end)
    block_tables: torch.Tensor
    seq_lens: torch.Tensor  # [num_reqs] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: offsets of each request's tokens
    max_query_len: int
    max_seq_len: int
    # Requests of up to this many tokens are attended as decodes (ops.paged_attention): 1, or
    # with speculative decoding 1 + the drafts a row verifies.
    decode_queries: int = 1
    # With layer groups (shared/kv_groups.py): each group's tables and slots (this one the
    # first's); a layer attends with its group's
    groups: list[AttentionMetadata] | None = None

    def of_group(self, group: int) -> AttentionMetadata:
        return self if self.groups is None else self.groups[group]
