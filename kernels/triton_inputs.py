"""Input token ids gathered from the last sampled ids on the device, in Triton.

Same as `kernels.inputs.gather_sampled_inputs_reference`, in one launch instead of four small
torch ops: it runs in every decode step (inside the CUDA graph), where launches are the cost.
A speculative proposer's per-step rows (`catch_up_rows`, `draft_pass_inputs`) likewise.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.triton_pdl import launches_early, wait_for_previous_kernel

_BLOCK = 1024


@triton.jit
def _gather_kernel(
    input_ids_ptr,
    source_rows_ptr,
    sampled_ids_ptr,
    num_tokens,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
):
    wait_for_previous_kernel(PDL)
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    rows = tl.load(source_rows_ptr + tokens, mask=tokens < num_tokens, other=-1)  # [BLOCK]
    take = rows >= 0
    ids = tl.load(sampled_ids_ptr + rows, mask=take, other=0)  # [BLOCK]
    tl.store(input_ids_ptr + tokens, ids.to(input_ids_ptr.dtype.element_ty), mask=take)


def gather_sampled_inputs(
    input_ids: torch.Tensor,  # [num_tokens] int32, updated in place
    source_rows: torch.Tensor,  # [num_tokens] int32: row of sampled_ids to take, or -1
    sampled_ids: torch.Tensor,  # [max_reqs] int64: the last step's sampled token ids
) -> None:
    if input_ids.shape != source_rows.shape or input_ids.dim() != 1:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and source_rows {tuple(source_rows.shape)} "
            "must be the same [num_tokens]"
        )
    if not (
        input_ids.is_contiguous() and source_rows.is_contiguous() and sampled_ids.is_contiguous()
    ):
        raise ValueError("input_ids, source_rows and sampled_ids must be contiguous")
    num_tokens = input_ids.shape[0]
    if num_tokens == 0:
        return
    grid = (triton.cdiv(num_tokens, _BLOCK),)
    early = launches_early(input_ids)
    _gather_kernel[grid](
        input_ids, source_rows, sampled_ids, num_tokens, BLOCK=_BLOCK, PDL=early, launch_pdl=early
    )


@triton.jit
def _draft_pass_kernel(
    last_ptr,
    drafting_ptr,
    row_blocks_ptr,
    tables_ptr,
    slots_ptr,
    seq_lens_ptr,
    rotary_ptr,
    num_rows,
    step,
    table_stride,
    max_blocks,
    block_size,
    max_model_len,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    valid = rows < num_rows
    positions = tl.load(last_ptr + rows, mask=valid, other=0).to(tl.int64) + step
    drafting = tl.load(drafting_ptr + rows, mask=valid, other=0) != 0
    held = tl.load(row_blocks_ptr + rows, mask=valid, other=0)
    columns = positions // block_size
    room = drafting & (columns < held) & (positions < max_model_len)
    column = tl.minimum(columns, max_blocks - 1)
    block = tl.load(tables_ptr + rows.to(tl.int64) * table_stride + column, mask=valid, other=0)
    slots = tl.where(room, block.to(tl.int64) * block_size + positions % block_size, -1)
    tl.store(slots_ptr + rows, slots.to(tl.int32), mask=valid)
    tl.store(seq_lens_ptr + rows, tl.where(room, positions + 1, 1).to(tl.int32), mask=valid)
    rotary = tl.minimum(positions, max_model_len - 1)
    tl.store(rotary_ptr + rows, rotary.to(tl.int32), mask=valid)


def draft_pass_inputs(
    last: torch.Tensor,  # [R] int: each row's drafting position
    step: int,
    drafting: torch.Tensor,  # [R] bool
    row_blocks: torch.Tensor,  # [R] int
    block_tables: torch.Tensor,  # [>= R, max_blocks] int32
    block_size: int,
    max_model_len: int,
    slot_mapping: torch.Tensor,  # [R] int32, out
    seq_lens: torch.Tensor,  # [R] int32, out
    rotary_positions: torch.Tensor,  # [R] int32, out
) -> None:
    """`kernels.inputs.draft_pass_inputs_reference` in one launch instead of some twenty small
    torch ops: each EAGLE-3 draft pass after the first runs it, inside the head's CUDA graph."""
    num_rows = last.shape[0]
    outs = (slot_mapping, seq_lens, rotary_positions)
    if any(out.shape != (num_rows,) or out.dtype != torch.int32 for out in outs):
        raise ValueError("slot_mapping, seq_lens and rotary_positions must be [R] int32")
    if block_tables.stride(1) != 1 or not all(t.is_contiguous() for t in (last, row_blocks)):
        raise ValueError("block_tables' rows, last and row_blocks must be contiguous")
    if num_rows == 0:
        return
    _draft_pass_kernel[(triton.cdiv(num_rows, _BLOCK),)](
        last, drafting.view(torch.uint8), row_blocks, block_tables, *outs, num_rows, step,
        block_tables.stride(0), block_tables.shape[1], block_size, max_model_len, BLOCK=_BLOCK,
    )  # fmt: skip


# NOTE: the counts follow each step's rows and samples; not specialised (1, a multiple of 16),
# a new count never compiles a variant inside a running server.
@triton.jit(do_not_specialize=["num_rows", "num_verified", "num_checked", "num_sampled"])
def _catch_up_rows_kernel(
    base_ptr,
    blocks_ptr,
    first_ptr,
    drafts_ptr,
    sampled_ptr,
    positions_ptr,
    row_blocks_ptr,
    accepted_ptr,
    drafting_ptr,
    at_ptr,
    last_ptr,
    num_rows,
    num_verified,  # rows with an accepted count (first_sample's, drafts')
    num_checked,  # rows held to the samples: num_verified, or 0 without samples
    num_sampled,
    K: tl.constexpr,  # drafts a row
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    valid = rows < num_rows
    checked = rows < num_checked
    base = tl.load(base_ptr + rows, mask=valid, other=-1)
    tl.store(row_blocks_ptr + rows, tl.load(blocks_ptr + rows, mask=valid, other=0), mask=valid)
    accepted = tl.zeros([BLOCK], tl.int64)
    first = tl.load(first_ptr + rows, mask=checked, other=0)
    going = checked
    for j in tl.static_range(K):  # the leading drafts equal to their samples
        index = tl.minimum(tl.maximum(first + j, 0), num_sampled - 1)
        sample = tl.load(sampled_ptr + index, mask=checked, other=0).to(tl.int64)
        draft = tl.load(drafts_ptr + rows * K + j, mask=checked, other=0)
        going = going & (sample == draft)
        accepted += going.to(tl.int64)
    tl.store(accepted_ptr + rows, accepted, mask=rows < num_verified)
    at = tl.where(base >= 0, base + accepted, 0)
    tl.store(drafting_ptr + rows, (base >= 0).to(tl.uint8), mask=valid)
    tl.store(at_ptr + rows, at, mask=valid)
    last = tl.load(positions_ptr + at, mask=valid, other=0)
    tl.store(last_ptr + rows, last.to(tl.int64), mask=valid)


def catch_up_rows(
    base: torch.Tensor,  # [R] int64
    blocks: torch.Tensor,  # [R] int64
    first_sample: torch.Tensor,  # [V] int64
    drafts: torch.Tensor,  # [V, k] int64
    sampled: torch.Tensor | None,  # [S]
    positions: torch.Tensor,  # [T] int
    *outs: torch.Tensor,  # row_blocks, accepted, drafting, at, last
) -> None:
    """`kernels.inputs.catch_up_rows_reference` in one launch instead of some fifteen small
    torch ops: it runs after every speculative step, before the proposer's graphs."""
    row_blocks, accepted, drafting, at, last = outs
    num_rows, num_verified = base.shape[0], first_sample.shape[0]
    if drafting.dtype != torch.bool or any(
        t.dtype != torch.int64 or not t.is_contiguous()
        for t in (base, blocks, first_sample, drafts, row_blocks, accepted, at, last)
    ):
        raise ValueError("the rows must be contiguous int64 (drafting: bool)")
    positions = positions.contiguous()  # read by index (no copy where it is already)
    sampled = None if sampled is None else sampled.contiguous()
    if num_rows == 0:
        return
    # Without samples, no row is held to them: one variant either way (no constant differs).
    verify = sampled is not None and sampled.shape[0] > 0
    _catch_up_rows_kernel[(triton.cdiv(num_rows, _BLOCK),)](
        base, blocks, first_sample, drafts, sampled if verify else base, positions, row_blocks,
        accepted, drafting.view(torch.uint8), at, last, num_rows, num_verified,
        num_verified if verify else 0, sampled.shape[0] if verify else 1,
        K=max(drafts.shape[1], 1), BLOCK=_BLOCK,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_tokens", "num_sampled"])
def _next_token_ids_kernel(
    input_ids_ptr,
    sample_rows_ptr,
    sampled_ptr,
    out_ptr,
    num_tokens,
    num_sampled,
    BLOCK: tl.constexpr,
):
    # One program: the samples' writes must land after the copy's (a block barrier orders
    # them; programs of a grid have no order).
    for start in range(0, num_tokens - 1, BLOCK):
        tokens = start + tl.arange(0, BLOCK)
        inside = tokens < num_tokens - 1
        ids = tl.load(input_ids_ptr + tokens + 1, mask=inside, other=0)
        tl.store(out_ptr + tokens, ids.to(out_ptr.dtype.element_ty), mask=inside)
    tl.debug_barrier()
    for start in range(0, num_sampled, BLOCK):
        index = start + tl.arange(0, BLOCK)
        inside = index < num_sampled
        rows = tl.load(sample_rows_ptr + index, mask=inside, other=0)
        ids = tl.load(sampled_ptr + index, mask=inside, other=0)
        tl.store(out_ptr + rows, ids.to(out_ptr.dtype.element_ty), mask=inside)


def next_token_ids(
    input_ids: torch.Tensor,  # [>= T] int
    sample_rows: torch.Tensor,  # [S] int
    sampled: torch.Tensor | None,  # [S] int
    out: torch.Tensor,  # [>= T] int32
    num_tokens: int,
) -> None:
    """`kernels.inputs.next_token_ids_reference` in one launch instead of four small torch
    ops: an EAGLE-3 head's catch-up runs it after every step."""
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    # Read by index (no copy where they are already contiguous).
    input_ids, sample_rows = input_ids.contiguous(), sample_rows.contiguous()
    sampled = None if sampled is None else sampled.contiguous()
    if num_tokens == 0:
        return
    num_sampled = 0 if sampled is None else sampled.shape[0]
    _next_token_ids_kernel[(1,)](
        input_ids, sample_rows, _no_samples(out.device) if sampled is None else sampled, out,
        num_tokens, num_sampled, BLOCK=_BLOCK,
    )  # fmt: skip


@functools.cache
def _no_samples(device: torch.device) -> torch.Tensor:
    """A stand-in for no samples, of the samples' dtype (int64): the same variant either way;
    never read (no sample to read)."""
    return torch.zeros(1, dtype=torch.int64, device=device)
