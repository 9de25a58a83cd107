"""Batched LoRA shrink and expand in Triton: one launch each per projection for a whole step.

Same arguments as `kernels.lora` (read its docstring). Up to ONE_BY_ONE_MAX_TOKENS tokens
(every decode step a CUDA graph holds) a program takes one token; past that a program owns
BLOCK_T tokens: where they all share one slot (the tokens of one request: a prompt, a chunk) it
multiplies them together with tl.dot, where they do not (a block across two requests) it takes
them one by one. The grid depends on the token count only, and each token's slot is read on
the device, so a launch replays in a CUDA graph with the step's slots as an input. A slot
outside 0 .. S - 1 (-1, or a stale padding row) reads as no adapter.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

DOT_MIN = 16  # tl.dot needs every dimension >= 16
ONE_BY_ONE_MAX_TOKENS = 512  # a program per token up to here (cuda_graphs' largest decode)
BLOCK_T = 16  # past that, tokens per program


@triton.jit
def _slot(slots_ptr, token, num_tokens, num_slots):
    """A token's slot; -1 for none, past the tokens, or outside the slots."""
    slot = tl.load(slots_ptr + token, mask=token < num_tokens, other=-1)
    return tl.where(slot < num_slots, slot, -1)


@triton.jit
def _slot_range(slots_ptr, tokens, valid, num_slots):
    """The smallest and largest slot of the block's tokens (-1: no adapter)."""
    slots = tl.load(slots_ptr + tokens, mask=valid, other=-1)
    slots = tl.where(slots < num_slots, slots, -1)
    low = tl.min(tl.where(valid, slots, 2**30), axis=0)
    high = tl.max(tl.where(valid, slots, -(2**30)), axis=0)
    return low, high


@triton.jit
def _shrink_token(
    x_ptr, a_ptr, slots_ptr, out_ptr, token, num_tokens, num_slots, k, stride_x_token,
    stride_a_slot, stride_a_rank, stride_out_token, piece_a, piece_out, RANK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[token, piece] = A[slot] x[token]: a GEMV over K in blocks, zero without a slot."""
    ranks = tl.arange(0, RANK)
    cols = tl.arange(0, BLOCK_K)
    slot = _slot(slots_ptr, token, num_tokens, num_slots)
    acc = tl.zeros([RANK], tl.float32)
    if slot >= 0:
        a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + piece_a
        x_row = x_ptr + token.to(tl.int64) * stride_x_token
        for k_start in range(0, k, BLOCK_K):
            col_valid = k_start + cols < k
            x = tl.load(x_row + k_start + cols, mask=col_valid, other=0.0)  # [BK]
            a_ptrs = a_rows + ranks[:, None] * stride_a_rank + (k_start + cols)[None, :]
            a = tl.load(a_ptrs, mask=col_valid[None, :], other=0.0)  # [R, BK]
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if token < num_tokens:
        tl.store(out_ptr + token.to(tl.int64) * stride_out_token + piece_out + ranks, acc)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [S, P, R, K]
    slots_ptr,  # [T] int32
    out_ptr,  # [T, P, R] float32
    num_tokens,
    num_slots,
    k,
    stride_x_token,
    stride_a_slot,
    stride_a_piece,
    stride_a_rank,
    stride_out_token,
    stride_out_piece,
    RANK: tl.constexpr,
    BLOCK_T: tl.constexpr,  # 1, or >= 16 for tl.dot
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    piece = tl.program_id(1)
    piece_a, piece_out = piece * stride_a_piece, piece * stride_out_piece
    first = tl.program_id(0).to(tl.int64) * BLOCK_T
    if BLOCK_T == 1:
        _shrink_token(
            x_ptr, a_ptr, slots_ptr, out_ptr, first, num_tokens, num_slots, k, stride_x_token,
            stride_a_slot, stride_a_rank, stride_out_token, piece_a, piece_out, RANK, BLOCK_K,
        )  # fmt: skip
    else:
        tokens = first + tl.arange(0, BLOCK_T)  # [BT] int64
        valid = tokens < num_tokens
        low, high = _slot_range(slots_ptr, tokens, valid, num_slots)
        if low == high:  # one adapter (or none) for the whole block: tl.dot
            ranks = tl.arange(0, RANK)
            cols = tl.arange(0, BLOCK_K)
            acc = tl.zeros([BLOCK_T, RANK], tl.float32)
            if low >= 0:
                a_rows = a_ptr + low.to(tl.int64) * stride_a_slot + piece_a
                x_rows = x_ptr + tokens[:, None] * stride_x_token
                for k_start in range(0, k, BLOCK_K):
                    col_valid = k_start + cols < k
                    x_mask = valid[:, None] & col_valid[None, :]
                    x = tl.load(x_rows + (k_start + cols)[None, :], mask=x_mask, other=0.0)
                    a_ptrs = a_rows + ranks[:, None] * stride_a_rank + (k_start + cols)[None, :]
                    a = tl.load(a_ptrs, mask=col_valid[None, :], other=0.0)  # [R, BK]
                    acc = tl.dot(x, tl.trans(a), acc, input_precision=DOT_PRECISION)
            out_ptrs = out_ptr + tokens[:, None] * stride_out_token + piece_out + ranks[None, :]
            tl.store(out_ptrs, acc, mask=valid[:, None])
        else:  # a block across requests: token by token
            for i in tl.static_range(BLOCK_T):
                _shrink_token(
                    x_ptr, a_ptr, slots_ptr, out_ptr, first + i, num_tokens, num_slots, k,
                    stride_x_token, stride_a_slot, stride_a_rank, stride_out_token, piece_a,
                    piece_out, RANK, BLOCK_K,
                )  # fmt: skip


@triton.jit
def _expand_token(
    out_ptr, y_ptr, b_ptr, slots_ptr, token, num_tokens, num_slots, rows, row_valid,
    stride_out_token, stride_y_token, piece_y, stride_b_slot, stride_b_row, RANK: tl.constexpr,
):  # fmt: skip
    """out[token, rows] += B[slot, rows] y[token, piece]; nothing without a slot."""
    ranks = tl.arange(0, RANK)
    slot = _slot(slots_ptr, token, num_tokens, num_slots)
    if slot >= 0:
        y = tl.load(y_ptr + token.to(tl.int64) * stride_y_token + piece_y + ranks)  # [R]
        b_ptrs = b_ptr + slot.to(tl.int64) * stride_b_slot + rows[:, None] * stride_b_row
        b = tl.load(b_ptrs + ranks[None, :], mask=row_valid[:, None], other=0.0)  # [BN, R]
        delta = tl.sum(b.to(tl.float32) * y[None, :], axis=1)  # [BN]
        out_ptrs = out_ptr + token.to(tl.int64) * stride_out_token + rows
        out = tl.load(out_ptrs, mask=row_valid, other=0.0).to(tl.float32) + delta
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid)


@triton.jit
def _lora_expand_kernel(
    out_ptr,  # [T, N]
    y_ptr,  # [T, P, R] float32
    b_ptr,  # [S, N, R]
    slots_ptr,  # [T] int32
    num_tokens,
    num_slots,
    n,
    piece_start_1,  # the first row of piece 1 (n if none)
    piece_start_2,  # the first row of piece 2 (n if none)
    stride_out_token,
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
            out_ptr, y_ptr, b_ptr, slots_ptr, first, num_tokens, num_slots, rows, row_valid,
            stride_out_token, stride_y_token, piece_y, stride_b_slot, stride_b_row, RANK,
        )  # fmt: skip
    else:
        tokens = first + tl.arange(0, BLOCK_T)  # [BT] int64
        valid = tokens < num_tokens
        low, high = _slot_range(slots_ptr, tokens, valid, num_slots)
        if low == high:
            if low >= 0:
                ranks = tl.arange(0, RANK)
                y_ptrs = y_ptr + tokens[:, None] * stride_y_token + piece_y + ranks[None, :]
                y = tl.load(y_ptrs, mask=valid[:, None], other=0.0)  # [BT, R]
                b_ptrs = b_ptr + low.to(tl.int64) * stride_b_slot + rows[:, None] * stride_b_row
                b = tl.load(b_ptrs + ranks[None, :], mask=row_valid[:, None], other=0.0)
                delta = tl.dot(y, tl.trans(b.to(tl.float32)), input_precision=DOT_PRECISION)
                out_ptrs = out_ptr + tokens[:, None] * stride_out_token + rows[None, :]
                mask = valid[:, None] & row_valid[None, :]
                out = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + delta
                tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            for i in tl.static_range(BLOCK_T):
                _expand_token(
                    out_ptr, y_ptr, b_ptr, slots_ptr, first + i, num_tokens, num_slots, rows,
                    row_valid, stride_out_token, stride_y_token, piece_y, stride_b_slot,
                    stride_b_row, RANK,
                )  # fmt: skip


def _block_t(num_tokens: int, rank: int, block_n: int = DOT_MIN) -> int:
    """A program per token up to ONE_BY_ONE_MAX_TOKENS, and where tl.dot cannot run (a rank
    or an output block under 16); blocks of BLOCK_T tokens past that."""
    one_by_one = num_tokens <= ONE_BY_ONE_MAX_TOKENS or min(rank, block_n) < DOT_MIN
    return 1 if one_by_one else BLOCK_T


def _check_slots(rank: int, token_slots: torch.Tensor, num_tokens: int) -> None:
    if rank & (rank - 1):
        raise ValueError(f"LoRA slots need a power-of-two rank (zero-padded), got {rank}")
    if token_slots.shape != (num_tokens,) or token_slots.dtype != torch.int32:
        raise ValueError(f"token_slots must be int32 [{num_tokens}], got {token_slots.dtype}")


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, P, R, K]
    token_slots: torch.Tensor,  # [T] int32, -1: none
    *,
    block_t: int | None = None,  # tokens per program (1, or >= 16); None: _block_t
) -> torch.Tensor:  # [T, P, R] float32
    """`kernels.lora.lora_shrink_reference`."""
    num_tokens, k = x.shape
    num_slots, num_pieces, rank = lora_a.shape[:3]
    _check_slots(rank, token_slots, num_tokens)
    if lora_a.shape[3] != k or lora_a.stride(3) != 1 or x.stride(1) != 1:
        raise ValueError(f"lora_a {tuple(lora_a.shape)} and x {tuple(x.shape)} disagree on K")
    out = torch.empty(num_tokens, num_pieces, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    block_t = block_t or _block_t(num_tokens, rank)
    _lora_shrink_kernel[(triton.cdiv(num_tokens, block_t), num_pieces)](
        x,
        lora_a,
        token_slots,
        out,
        num_tokens,
        num_slots,
        k,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        out.stride(0),
        out.stride(1),
        RANK=rank,
        BLOCK_T=block_t,
        BLOCK_K=min(256, triton.next_power_of_2(k)),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return out


def lora_expand(
    out: torch.Tensor,  # [T, N], added to in place
    shrunk: torch.Tensor,  # [T, P, R] float32
    lora_b: torch.Tensor,  # [S, N, R]
    token_slots: torch.Tensor,  # [T] int32, -1: none
    piece_rows: tuple[int, ...],  # output rows of each piece, summing to N
    *,
    block_t: int | None = None,  # tokens per program (1, or >= 16); None: _block_t
) -> torch.Tensor:  # out
    """`kernels.lora.lora_expand_reference`."""
    num_tokens, n = out.shape
    num_slots, _, rank = lora_b.shape
    _check_slots(rank, token_slots, num_tokens)
    if sum(piece_rows) != n or len(piece_rows) > 3:
        raise ValueError(f"pieces of {piece_rows} rows do not make {n} outputs (at most 3)")
    if shrunk.shape != (num_tokens, len(piece_rows), rank) or shrunk.stride(2) != 1:
        raise ValueError(f"shrunk {tuple(shrunk.shape)} is not [{num_tokens}, pieces, {rank}]")
    if lora_b.shape[1] != n or lora_b.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError(f"lora_b {tuple(lora_b.shape)} does not hold {n} output rows")
    if num_tokens == 0:
        return out
    piece_ends = [sum(piece_rows[: i + 1]) for i in range(len(piece_rows))] + [n, n]
    rows_gcd = math.gcd(*piece_rows)
    block_n = min(128, rows_gcd & -rows_gcd)  # the largest power of two that divides all
    block_t = block_t or _block_t(num_tokens, rank, block_n)
    _lora_expand_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(n, block_n))](
        out,
        shrunk,
        lora_b,
        token_slots,
        num_tokens,
        num_slots,
        n,
        piece_ends[0] if len(piece_rows) > 1 else n,  # where piece 1 starts
        piece_ends[1] if len(piece_rows) > 2 else n,  # where piece 2 starts
        out.stride(0),
        shrunk.stride(0),
        shrunk.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        RANK=rank,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if out.dtype == torch.float32 else "tf32",
    )
    return out
