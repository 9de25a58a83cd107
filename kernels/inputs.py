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


def draft_pass_inputs_reference(
    last: torch.Tensor,  # [R] int: each row's drafting position
    step: int,  # this pass drafts at last + step
    drafting: torch.Tensor,  # [R] bool: whether the row drafts at all
    row_blocks: torch.Tensor,  # [R] int: the blocks the row holds
    block_tables: torch.Tensor,  # [>= R, max_blocks] int32
    block_size: int,
    max_model_len: int,
    slot_mapping: torch.Tensor,  # [R] int32, out: the KV slot at the position, or -1
    seq_lens: torch.Tensor,  # [R] int32, out: the context it attends to
    rotary_positions: torch.Tensor,  # [R] int32, out: the position, kept under max_model_len
) -> None:
    """An EAGLE-3 draft pass's inputs, on the device: a row writes its KV at last + step where
    it drafts, holds a block there and the position is under max_model_len, and attends to
    the context up to it; else it writes nothing (slot -1) and attends to one token."""
    positions = last.long() + step
    columns = positions // block_size
    room = drafting & (columns < row_blocks) & (positions < max_model_len)
    column = columns.clamp(max=block_tables.shape[1] - 1)[:, None]
    blocks = block_tables[: last.shape[0]].long().gather(1, column).squeeze(1)
    slots = torch.where(room, blocks * block_size + positions % block_size, -1)
    slot_mapping.copy_(slots)
    seq_lens.copy_(torch.where(room, positions + 1, 1))
    rotary_positions.copy_(positions.clamp(max=max_model_len - 1))


def catch_up_rows_reference(
    base: torch.Tensor,  # [R] int64: each row's first sampled position's index, -1: no drafts
    blocks: torch.Tensor,  # [R] int64: the blocks each row holds
    first_sample: torch.Tensor,  # [V] int64, V <= R: each verified row's first sample's index
    drafts: torch.Tensor,  # [V, k] int64: the drafts each verified, -1 past its own
    sampled: torch.Tensor | None,  # [S]: the step's samples (None: nothing verified)
    positions: torch.Tensor,  # [T] int: the step's positions
    row_blocks: torch.Tensor,  # [R] int64, out: blocks
    accepted: torch.Tensor,  # [V] int64, out: the leading drafts equal to the samples
    drafting: torch.Tensor,  # [R] bool, out: whether the row drafts (base >= 0)
    at: torch.Tensor,  # [R] int64, out: its drafting position's index, base + accepted (or 0)
    last: torch.Tensor,  # [R] int64, out: the position at `at`
) -> None:
    """A speculative step's catch-up rows, on the device: each row's drafts accepted (those
    equal to the samples before them, in order: sample i + 1 was drawn after draft i), so its
    drafting position; a sample's index is clamped into [0, S)."""
    row_blocks.copy_(blocks)
    accepted.zero_()
    if sampled is not None and first_sample.numel():
        k = drafts.shape[1]
        columns = torch.arange(k, device=base.device)
        index = (first_sample[:, None] + columns).clamp(0, sampled.shape[0] - 1)
        equal = sampled[index] == drafts  # a -1 (no draft) equals no sample
        accepted.copy_(equal.long().cumprod(dim=1).sum(dim=1))
    gained = torch.zeros_like(base)
    gained[: accepted.shape[0]] = accepted
    drafting.copy_(base >= 0)
    at.copy_(torch.where(drafting, base + gained, 0))
    last.copy_(positions[at])


def next_token_ids_reference(
    input_ids: torch.Tensor,  # [>= T] int: the step's input ids
    sample_rows: torch.Tensor,  # [S] int: the token index of each sample
    sampled: torch.Tensor | None,  # [S] int: the samples (None: the step sampled nothing)
    out: torch.Tensor,  # [>= T] int32: the token after each position, written [0, T - 1)
    num_tokens: int,  # T
) -> None:
    """The token after each position of a step: the next input token, or the sample where the
    position sampled (an EAGLE-3 head's catch-up reads the token after its position). The
    last position's is written only where it sampled."""
    out[: num_tokens - 1].copy_(input_ids[1:num_tokens])
    if sampled is not None:
        out[sample_rows.long()] = sampled.to(out.dtype)
