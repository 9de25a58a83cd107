"""Batched LoRA shrink and expand in Triton: one launch each per projection for a whole step.

Same arguments as `kernels.lora` (read its docstring). Up to ONE_BY_ONE_MAX_TOKENS tokens a
program takes one token. Past that a program owns BLOCK_T tokens, taken in `token_order`, which
groups the step's tokens by slot (the executor sorts them): it multiplies the tokens of each
slot in the block together with tl.dot, so each adapter's A or B tile is read once per block
rather than once per token (Punica's and S-LoRA's segmented GEMM). The shrink also splits K, so
that a step of a few tokens still runs about MIN_PROGRAMS programs (one program reading a whole
A of 14336 columns took 19 us per launch on an H100); each split writes its partial sum, and
the expand adds them up. The grid depends on the token count only, and the slots and the order
are read on the device, so a launch replays in a CUDA graph with them as inputs. A slot outside
0 .. S - 1 (-1, or a stale padding row) reads as no adapter.
"""

from __future__ import annotations

import itertools
import math

import torch
import triton
import triton.language as tl

DOT_MIN = 16  # tl.dot needs every dimension >= 16
ONE_BY_ONE_MAX_TOKENS = 16  # a program per token up to here (batch-1..16 decode)
BLOCK_T = 16  # past that, tokens per program
MIN_PROGRAMS = 512  # the shrink splits K until its grid has about this many programs
SPLIT_BLOCK = tl.constexpr(8)  # partial sums an expand loads at once


@triton.jit
def _slot(slots_ptr, token, num_tokens, num_slots):
    """A token's slot; -1 for none, past the tokens, or outside the slots."""
    slot = tl.load(slots_ptr + token, mask=token < num_tokens, other=-1)
    return tl.where(slot < num_slots, slot, -1)


@triton.jit
def _summed_splits(y_ptrs, num_splits, stride_y_split, rows_valid=None):
    """The sum over the shrink's splits of the partial sums at y_ptrs [rows, R] (rows where
    rows_valid, zero elsewhere), SPLIT_BLOCK splits per load."""
    splits = tl.arange(0, SPLIT_BLOCK)
    y = tl.zeros(y_ptrs.shape, tl.float32)
    for first in range(0, num_splits, SPLIT_BLOCK):
        mask = (first + splits < num_splits)[:, None, None]
        if rows_valid is not None:
            mask = mask & rows_valid[None, :, None]
        ptrs = y_ptrs[None, :, :] + (first + splits)[:, None, None] * stride_y_split
        y += tl.sum(tl.load(ptrs, mask=mask, other=0.0), axis=0)
    return y


@triton.jit
def lora_rows(
    y_ptr, slots_ptr, rows, row_valid, first_col, num_slots, num_splits, piece_start_1,
    piece_start_2, stride_y_split, stride_y_token, stride_y_piece, RANK: tl.constexpr,
):  # fmt: skip
    """What a linear kernel that fuses the expand (kernels/triton_linear.py) reads of its rows:
    each row's slot, whether it has one, and y [rows, R] of the piece holding the columns from
    first_col (summed over the shrink's splits; zero without a slot)."""
    slots = tl.load(slots_ptr + rows, mask=row_valid, other=-1)  # [BM]
    adapted = row_valid & (slots >= 0) & (slots < num_slots)
    slots = tl.where(adapted, slots, 0).to(tl.int64)
    piece = (first_col >= piece_start_1).to(tl.int32) + (first_col >= piece_start_2).to(tl.int32)
    ranks = tl.arange(0, RANK)
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y_token + piece * stride_y_piece
    y = _summed_splits(y_ptrs + ranks[None, :], num_splits, stride_y_split, adapted)  # [BM, R]
    return slots, adapted, y


@triton.jit
def lora_b(
    b_ptr, slots, adapted, cols, col_valid, stride_b_slot, stride_b_row, RANK: tl.constexpr
):  # fmt: skip
    """B [rows, cols, R]: each row's adapter's rows of B for the output columns `cols`."""
    ranks = tl.arange(0, RANK)
    b_ptrs = b_ptr + slots[:, None, None] * stride_b_slot + ranks[None, None, :]
    b_ptrs += cols[None, :, None].to(tl.int64) * stride_b_row  # [BM, BN, R]
    return tl.load(b_ptrs, mask=adapted[:, None, None] & col_valid[None, :, None], other=0.0)


@triton.jit
def lora_delta(y, b):
    """[rows, cols] float32: y [rows, R] times B [rows, cols, R], row by row."""
    return tl.sum(b.to(tl.float32) * y[:, None, :], axis=2)


@triton.jit
def _shrink_token(
    x_ptr, a_ptr, slots_ptr, out_ptr, token, num_tokens, num_slots, k_first, k_end,
    stride_x_token, stride_a_slot, stride_a_rank, stride_out_token, piece_a, piece_out,
    RANK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[token, piece] = A[slot] x[token] over columns k_first..k_end: a GEMV in blocks,
    zero without a slot."""
    ranks = tl.arange(0, RANK)
    cols = tl.arange(0, BLOCK_K)
    slot = _slot(slots_ptr, token, num_tokens, num_slots)
    acc = tl.zeros([RANK], tl.float32)
    if slot >= 0:
        a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + piece_a
        x_row = x_ptr + token.to(tl.int64) * stride_x_token
        for k_start in range(k_first, k_end, BLOCK_K):
            col_valid = k_start + cols < k_end
            x = tl.load(x_row + k_start + cols, mask=col_valid, other=0.0)  # [BK]
            a_ptrs = a_rows + ranks[:, None] * stride_a_rank + (k_start + cols)[None, :]
            a = tl.load(a_ptrs, mask=col_valid[None, :], other=0.0)  # [R, BK]
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if token < num_tokens:
        tl.store(out_ptr + token.to(tl.int64) * stride_out_token + piece_out + ranks, acc)


@triton.jit
def _block_tokens(order_ptr, slots_ptr, first, num_tokens, num_slots, BLOCK_T: tl.constexpr):
    """The block's tokens, as the order lists them (their positions in the step), whether each
    is one, and its slot (-1: none, or not a token)."""
    places = first + tl.arange(0, BLOCK_T)  # [BT] int64
    valid = places < num_tokens
    tokens = tl.load(order_ptr + places, mask=valid, other=0).to(tl.int64)
    slots = tl.load(slots_ptr + tokens, mask=valid, other=-1)
    slots = tl.where(valid & (slots < num_slots), slots, -1)
    return tokens, valid, slots


@triton.jit
def _next_slot(slots, current):
    """The smallest slot of the block above `current` (2**30 when none is left)."""
    return tl.min(tl.where(slots > current, slots, 2**30), axis=0)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [S, P, R, K]
    slots_ptr,  # [T] int32
    order_ptr,  # [T] int32: the tokens grouped by slot (blocks read it; one by one does not)
    out_ptr,  # [KS, T, P, R] float32
    num_tokens,
    num_slots,
    k,
    k_per_split,  # a multiple of BLOCK_K
    stride_x_token,
    stride_a_slot,
    stride_a_piece,
    stride_a_rank,
    stride_out_split,
    stride_out_token,
    stride_out_piece,
    RANK: tl.constexpr,
    BLOCK_T: tl.constexpr,  # 1, or >= 16 for tl.dot
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    piece = tl.program_id(1)
    piece_a, piece_out = piece * stride_a_piece, piece * stride_out_piece
    split = tl.program_id(2)
    k_first = split * k_per_split
    k_end = tl.minimum(k_first + k_per_split, k)
    out_ptr += split.to(tl.int64) * stride_out_split
    first = tl.program_id(0).to(tl.int64) * BLOCK_T
    if BLOCK_T == 1:
        _shrink_token(
            x_ptr, a_ptr, slots_ptr, out_ptr, first, num_tokens, num_slots, k_first, k_end,
            stride_x_token, stride_a_slot, stride_a_rank, stride_out_token, piece_a, piece_out,
            RANK, BLOCK_K,
        )  # fmt: skip
    else:
        # The block's tokens, one adapter at a time: each slot's A is read once for all of its
        # tokens (with the order grouping tokens by slot, a block holds one or two adapters).
        tokens, valid, slots = _block_tokens(
            order_ptr, slots_ptr, first, num_tokens, num_slots, BLOCK_T
        )
        ranks = tl.arange(0, RANK)
        cols = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + tokens[:, None] * stride_x_token
        acc = tl.zeros([BLOCK_T, RANK], tl.float32)
        current = _next_slot(slots, -1)
        while current < num_slots:
            mine = slots == current
            a_rows = a_ptr + current.to(tl.int64) * stride_a_slot + piece_a
            for k_start in range(k_first, k_end, BLOCK_K):
                col_valid = k_start + cols < k_end
                x_mask = mine[:, None] & col_valid[None, :]
                x = tl.load(x_rows + (k_start + cols)[None, :], mask=x_mask, other=0.0)
                a_ptrs = a_rows + ranks[:, None] * stride_a_rank + (k_start + cols)[None, :]
                a = tl.load(a_ptrs, mask=col_valid[None, :], other=0.0)  # [R, BK]
                acc = tl.dot(x, tl.trans(a), acc, input_precision=DOT_PRECISION)
            current = _next_slot(slots, current)
        out_ptrs = out_ptr + tokens[:, None] * stride_out_token + piece_out + ranks[None, :]
        tl.store(out_ptrs, acc, mask=valid[:, None])


@triton.jit
def _expand_token(
    out_ptr, y_ptr, b_ptr, slots_ptr, token, num_tokens, num_slots, num_splits, rows, row_valid,
    stride_out_token, stride_y_split, stride_y_token, piece_y, stride_b_slot, stride_b_row,
    RANK: tl.constexpr,
):  # fmt: skip
    """out[token, rows] += B[slot, rows] (the sum of y's splits)[token, piece]; nothing
    without a slot."""
    ranks = tl.arange(0, RANK)
    slot = _slot(slots_ptr, token, num_tokens, num_slots)
    if slot >= 0:
        y_row = y_ptr + token.to(tl.int64) * stride_y_token + piece_y + ranks
        y = _summed_splits(y_row[None, :], num_splits, stride_y_split)  # [1, R]
        y = tl.reshape(y, [RANK])
        b_ptrs = b_ptr + slot.to(tl.int64) * stride_b_slot + rows[:, None] * stride_b_row
        b = tl.load(b_ptrs + ranks[None, :], mask=row_valid[:, None], other=0.0)  # [BN, R]
        delta = tl.sum(b.to(tl.float32) * y[None, :], axis=1)  # [BN]
        out_ptrs = out_ptr + token.to(tl.int64) * stride_out_token + rows
        out = tl.load(out_ptrs, mask=row_valid, other=0.0).to(tl.float32) + delta
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid)


@triton.jit
def _lora_expand_kernel(
    out_ptr,  # [T, N]
    y_ptr,  # [KS, T, P, R] float32
    b_ptr,  # [S, N, R]
    slots_ptr,  # [T] int32
    order_ptr,  # [T] int32: the tokens grouped by slot (blocks read it; one by one does not)
    num_tokens,
    num_slots,
    num_splits,
    n,
    piece_start_1,  # the first row of piece 1 (n if none)
    piece_start_2,  # the first row of piece 2 (n if none)
    stride_out_token,
    stride_y_split,
    stride_y_token,
    stride_y_piece,
    stride_b_slot,
    stride_b_row,
    RANK: tl.constexpr,
    BLOCK_T: tl.constexpr,  # 1, or >= 16 for tl.dot
    BLOCK_N: tl.constexpr,  # divides every piece's rows: a block lies in one piece
    DOT_PRECISION: tl.constexpr,
):
    first_row = tl.program_id(1) * BLOCK_N
    rows = first_row + tl.arange(0, BLOCK_N)  # [BN] output rows
    row_valid = rows < n
    piece = (first_row >= piece_start_1).to(tl.int32) + (first_row >= piece_start_2).to(tl.int32)
    piece_y = piece * stride_y_piece
    first = tl.program_id(0).to(tl.int64) * BLOCK_T
    if BLOCK_T == 1:
        _expand_token(
            out_ptr, y_ptr, b_ptr, slots_ptr, first, num_tokens, num_slots, num_splits, rows,
            row_valid, stride_out_token, stride_y_split, stride_y_token, piece_y, stride_b_slot,
            stride_b_row, RANK,
        )  # fmt: skip
    else:
        # As the shrink's blocks: one adapter at a time, each B tile read once per block.
        tokens, _, slots = _block_tokens(
            order_ptr, slots_ptr, first, num_tokens, num_slots, BLOCK_T
        )
        adapted = slots >= 0
        ranks = tl.arange(0, RANK)
        y_ptrs = y_ptr + tokens[:, None] * stride_y_token + piece_y + ranks[None, :]
        y = _summed_splits(y_ptrs, num_splits, stride_y_split, adapted)  # [BT, R]
        delta = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        current = _next_slot(slots, -1)
        while current < num_slots:
            b_ptrs = b_ptr + current.to(tl.int64) * stride_b_slot + rows[:, None] * stride_b_row
            b = tl.load(b_ptrs + ranks[None, :], mask=row_valid[:, None], other=0.0)  # [BN, R]
            mine = tl.where((slots == current)[:, None], y, 0.0)
            delta = tl.dot(mine, tl.trans(b.to(tl.float32)), delta, input_precision=DOT_PRECISION)
            current = _next_slot(slots, current)
        out_ptrs = out_ptr + tokens[:, None] * stride_out_token + rows[None, :]
        mask = adapted[:, None] & row_valid[None, :]
        out = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + delta
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _block_t(num_tokens: int, rank: int, block_n: int = DOT_MIN) -> int:
    """A program per token up to ONE_BY_ONE_MAX_TOKENS, and where tl.dot cannot run (a rank
    or an output block under 16); blocks of BLOCK_T tokens past that."""
    one_by_one = num_tokens <= ONE_BY_ONE_MAX_TOKENS or min(rank, block_n) < DOT_MIN
    return 1 if one_by_one else BLOCK_T


def _check_slots(
    rank: int, token_slots: torch.Tensor, token_order: torch.Tensor | None, num_tokens: int
) -> None:
    if rank & (rank - 1):
        raise ValueError(f"LoRA slots need a power-of-two rank (zero-padded), got {rank}")
    for name, tensor in (("token_slots", token_slots), ("token_order", token_order)):
        if tensor is not None and (tensor.shape != (num_tokens,) or tensor.dtype != torch.int32):
            raise ValueError(f"{name} must be int32 [{num_tokens}], got {tensor.dtype}")


def _order(token_order: torch.Tensor | None, token_slots: torch.Tensor) -> torch.Tensor:
    """The order the blocks take the tokens in: as they are, if none is given."""
    if token_order is not None:
        return token_order
    return torch.arange(len(token_slots), dtype=torch.int32, device=token_slots.device)


def check_delta(
    num_tokens: int,
    n: int,
    shrunk: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    piece_rows: tuple[int, ...],
) -> tuple[int, int]:
    """Check an expand's operands (as `kernels.lora.LoraDelta` holds them) for an output of
    num_tokens x n; where pieces 1 and 2 start (n where there is none)."""
    rank = lora_b.shape[2]
    _check_slots(rank, token_slots, None, num_tokens)
    if sum(piece_rows) != n or len(piece_rows) > 3:
        raise ValueError(f"pieces of {piece_rows} rows do not make {n} outputs (at most 3)")
    if shrunk.shape[1:] != (num_tokens, len(piece_rows), rank) or shrunk.stride(3) != 1:
        raise ValueError(
            f"shrunk {tuple(shrunk.shape)} is not [splits, {num_tokens}, pieces, {rank}]"
        )
    if lora_b.shape[1] != n or lora_b.stride(2) != 1:
        raise ValueError(f"lora_b {tuple(lora_b.shape)} does not hold {n} output rows")
    ends = list(itertools.accumulate(piece_rows))
    return (ends[0] if len(ends) > 1 else n, ends[1] if len(ends) > 2 else n)


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, P, R, K]
    token_slots: torch.Tensor,  # [T] int32, -1: none
    token_order: torch.Tensor | None = None,  # [T] int32, the tokens grouped by slot
    *,
    block_t: int | None = None,  # tokens per program (1, or >= 16); None: _block_t
    k_per_split: int | None = None,  # a power of two; None: _k_per_split
) -> torch.Tensor:  # [KS, T, P, R] float32
    """`kernels.lora.lora_shrink_reference`."""
    num_tokens, k = x.shape
    num_slots, num_pieces, rank = lora_a.shape[:3]
    _check_slots(rank, token_slots, token_order, num_tokens)
    token_order = _order(token_order, token_slots)
    if lora_a.shape[3] != k or lora_a.stride(3) != 1 or x.stride(1) != 1:
        raise ValueError(f"lora_a {tuple(lora_a.shape)} and x {tuple(x.shape)} disagree on K")
    block_t = block_t or _block_t(num_tokens, rank)
    block_k = min(256, triton.next_power_of_2(k), k_per_split or k)
    programs = triton.cdiv(num_tokens, block_t) * num_pieces
    k_per_split = k_per_split or _k_per_split(programs, k, block_k)
    num_splits = triton.cdiv(k, k_per_split)
    out = torch.empty(
        num_splits, num_tokens, num_pieces, rank, dtype=torch.float32, device=x.device
    )
    if num_tokens == 0:
        return out
    _lora_shrink_kernel[(triton.cdiv(num_tokens, block_t), num_pieces, num_splits)](
        x,
        lora_a,
        token_slots,
        token_order,
        out,
        num_tokens,
        num_slots,
        k,
        k_per_split,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        RANK=rank,
        BLOCK_T=block_t,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return out


def _k_per_split(programs: int, k: int, block_k: int) -> int:
    """Columns per split of K: whole blocks, and enough splits that the grid has about
    MIN_PROGRAMS programs (K whole once the tokens alone make as many)."""
    splits = max(1, min(MIN_PROGRAMS // programs, triton.cdiv(k, block_k)))
    return triton.cdiv(triton.cdiv(k, splits), block_k) * block_k


def lora_expand(
    out: torch.Tensor,  # [T, N], added to in place
    shrunk: torch.Tensor,  # [KS, T, P, R] float32, partial sums over parts of K
    lora_b: torch.Tensor,  # [S, N, R]
    token_slots: torch.Tensor,  # [T] int32, -1: none
    piece_rows: tuple[int, ...],  # output rows of each piece, summing to N
    token_order: torch.Tensor | None = None,  # [T] int32, the tokens grouped by slot
    *,
    block_t: int | None = None,  # tokens per program (1, or >= 16); None: _block_t
    block_n: int | None = None,  # output rows per program, dividing every piece; None: <= 128
) -> torch.Tensor:  # out
    """`kernels.lora.lora_expand_reference`."""
    num_tokens, n = out.shape
    num_slots, _, rank = lora_b.shape
    piece_starts = check_delta(num_tokens, n, shrunk, lora_b, token_slots, piece_rows)
    _check_slots(rank, token_slots, token_order, num_tokens)
    token_order = _order(token_order, token_slots)
    if out.stride(1) != 1:
        raise ValueError("out must be contiguous in its last (N) dimension")
    if num_tokens == 0:
        return out
    rows_gcd = math.gcd(*piece_rows)
    block_n = block_n or min(128, rows_gcd & -rows_gcd)  # the largest power of two dividing all
    if rows_gcd % block_n:
        raise ValueError(f"blocks of {block_n} rows would straddle pieces of {piece_rows}")
    block_t = block_t or _block_t(num_tokens, rank, block_n)
    _lora_expand_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(n, block_n))](
        out,
        shrunk,
        lora_b,
        token_slots,
        token_order,
        num_tokens,
        num_slots,
        shrunk.shape[0],
        n,
        *piece_starts,
        out.stride(0),
        shrunk.stride(0),
        shrunk.stride(1),
        shrunk.stride(2),
        lora_b.stride(0),
        lora_b.stride(1),
        RANK=rank,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if out.dtype == torch.float32 else "tf32",
    )
    return out
