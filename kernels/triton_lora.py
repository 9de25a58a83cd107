"""Batched LoRA shrink and expand in Triton: one launch each per projection for a whole step.

Same arguments as `kernels.lora` (read its docstring). A program owns BLOCK_T tokens. Where
they all share one slot (the tokens of one request: a prompt, a chunk) it multiplies them
together with tl.dot; where they do not (decode steps, where each token is its own request,
and blocks across two requests) it takes them one by one. Decode launches use BLOCK_T = 1, so
the grid depends on the token count only, and the slot of each token is read on the device:
the launch replays in a CUDA graph with the step's slots as an input.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

DOT_MIN = 16  # tl.dot needs every dimension >= 16
ONE_BY_ONE_MAX_TOKENS = 64  # up to this many tokens, a program per token
BLOCK_T = 16  # past that, tokens per program


@triton.jit
def _slot_range(slots_ptr, tokens, valid):
    """The smallest and largest slot of the block's tokens (-1: no adapter)."""
    slots = tl.load(slots_ptr + tokens, mask=valid, other=-1)
    low = tl.min(tl.where(valid, slots, 2**30), axis=0)
    high = tl.max(tl.where(valid, slots, -(2**30)), axis=0)
    return low, high


@triton.jit
def _shrink_token(
    x_ptr, a_ptr, slots_ptr, out_ptr, token, num_tokens, k, stride_x_token, stride_a_slot,
    stride_a_rank, stride_out_token, piece_a, piece_out, RANK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[token, piece] = A[slot] x[token]: a GEMV over K in blocks, zero without a slot."""
    ranks = tl.arange(0, RANK)
    cols = tl.arange(0, BLOCK_K)
    slot = tl.load(slots_ptr + token, mask=token < num_tokens, other=-1)
    acc = tl.zeros([RANK], tl.float32)
    if slot >= 0:
        a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + piece_a
        for k_start in range(0, k, BLOCK_K):
            col_valid = k_start + cols < k
            x = tl.load(x_ptr + token * stride_x_token + k_start + cols, mask=col_valid, other=0.0)
            a_ptrs = a_rows + ranks[:, None] * stride_a_rank + (k_start + cols)[None, :]
            a = tl.load(a_ptrs, mask=col_valid[None, :], other=0.0)  # [R, BK]
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if token < num_tokens:
        tl.store(out_ptr + token * stride_out_token + piece_out + ranks, acc)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [S, P, R, K]
    slots_ptr,  # [T] int32
    out_ptr,  # [T, P, R] float32
    num_tokens,
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
    first = tl.program_id(0) * BLOCK_T
    if BLOCK_T == 1:
        _shrink_token(
            x_ptr, a_ptr, slots_ptr, out_ptr, first, num_tokens, k, stride_x_token,
            stride_a_slot, stride_a_rank, stride_out_token, piece_a, piece_out, RANK, BLOCK_K,
        )  # fmt: skip
    else:
        tokens = first + tl.arange(0, BLOCK_T)  # [BT]
        valid = tokens < num_tokens
        low, high = _slot_range(slots_ptr, tokens, valid)
        if low == high:  # one adapter (or none) for the whole block: tl.dot
            ranks = tl.arange(0, RANK)
            cols = tl.arange(0, BLOCK_K)
            acc = tl.zeros([BLOCK_T, RANK], tl.float32)
            if low >= 0:
                a_rows = a_ptr + low.to(tl.int64) * stride_a_slot + piece_a
                for k_start in range(0, k, BLOCK_K):
                    col_valid = k_start + cols < k
                    x_ptrs = x_ptr + tokens[:, None] * stride_x_token + (k_start + cols)[None, :]
                    x = tl.load(x_ptrs, mask=valid[:, None] & col_valid[None, :], other=0.0)
                    a_ptrs = a_rows + ranks[:, None] * stride_a_rank + (k_start + cols)[None, :]
                    a = tl.load(a_ptrs, mask=col_valid[None, :], other=0.0)  # [R, BK]
                    acc = tl.dot(x, tl.trans(a), acc, input_precision=DOT_PRECISION)
            out_ptrs = out_ptr + tokens[:, None] * stride_out_token + piece_out + ranks[None, :]
            tl.store(out_ptrs, acc, mask=valid[:, None])
        else:  # a block across requests: token by token
            for i in tl.static_range(BLOCK_T):
                _shrink_token(
                    x_ptr, a_ptr, slots_ptr, out_ptr, first + i, num_tokens, k,
                    stride_x_token, stride_a_slot, stride_a_rank, stride_out_token, piece_a,
                    piece_out, RANK, BLOCK_K,
                )  # fmt: skip


@triton.jit
def _expand_token(
    out_ptr, y_ptr, b_ptr, slots_ptr, token, num_tokens, rows, row_valid, stride_out_token,
    stride_y_token, piece_y, stride_b_slot, stride_b_row, RANK: tl.constexpr,
):  # fmt: skip
    """out[token, rows] += B[slot, rows] y[token, piece]; nothing without a slot."""
    ranks = tl.arange(0, RANK)
    slot = tl.load(slots_ptr + token, mask=token < num_tokens, other=-1)
    if slot >= 0:
        y = tl.load(y_ptr + token * stride_y_token + piece_y + ranks)  # [R]
        b_ptrs = b_ptr + slot.to(tl.int64) * stride_b_slot + rows[:, None] * stride_b_row
        b = tl.load(b_ptrs + ranks[None, :], mask=row_valid[:, None], other=0.0)  # [BN, R]
        delta = tl.sum(b.to(tl.float32) * y[None, :], axis=1)  # [BN]
        out_ptrs = out_ptr + token * stride_out_token + rows
        out = tl.load(out_ptrs, mask=row_valid, other=0.0).to(tl.float32) + delta
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid)


@triton.jit
def _lora_expand_kernel(
    out_ptr,  # [T, N]
    y_ptr,  # [T, P, R] float32
    b_ptr,  # [S, N, R]
    slots_ptr,  # [T] int32
    num_tokens,
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
    first = tl.program_id(0) * BLOCK_T
    if BLOCK_T == 1:
        _expand_token(
            out_ptr, y_ptr, b_ptr, slots_ptr, first, num_tokens, rows, row_valid,
            stride_out_token, stride_y_token, piece_y, stride_b_slot, stride_b_row, RANK,
        )  # fmt: skip
    else:
        tokens = first + tl.arange(0, BLOCK_T)
        valid = tokens < num_tokens
        low, high = _slot_range(slots_ptr, tokens, valid)
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
                    out_ptr, y_ptr, b_ptr, slots_ptr, first + i, num_tokens, rows, row_valid,
                    stride_out_token, stride_y_token, piece_y, stride_b_slot, stride_b_row,
                    RANK,
                )  # fmt: skip


def _block_t(num_tokens: int, rank: int) -> int:
    """One token per program for decode-sized steps; blocks for prompts (tl.dot's 16)."""
    return 1 if num_tokens <= ONE_BY_ONE_MAX_TOKENS or rank < DOT_MIN else BLOCK_T


def _check(lora: torch.Tensor, token_slots: torch.Tensor, num_tokens: int) -> None:
    rank = lora.shape[-1] if lora.dim() == 3 else lora.shape[2]
    if rank & (rank - 1):
        raise ValueError(f"LoRA slots need a power-of-two rank (zero-padded), got {rank}")
    if token_slots.shape != (num_tokens,) or token_slots.dtype != torch.int32:
        raise ValueError(f"token_slots must be int32 [{num_tokens}], got {token_slots.dtype}")


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, P, R, K]
    token_slots: torch.Tensor,  # [T] int32, -1: none
) -> torch.Tensor:  # [T, P, R] float32
    """`kernels.lora.lora_shrink_reference`."""
    _check(lora_a, token_slots, x.shape[0])
    num_tokens, k = x.shape
    num_pieces, rank = lora_a.shape[1], lora_a.shape[2]
    if lora_a.shape[3] != k or lora_a.stride(3) != 1 or x.stride(1) != 1:
        raise ValueError(f"lora_a {tuple(lora_a.shape)} and x {tuple(x.shape)} disagree on K")
    out = torch.empty(num_tokens, num_pieces, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    block_t = _block_t(num_tokens, rank)
    _lora_shrink_kernel[(triton.cdiv(num_tokens, block_t), num_pieces)](
        x,
        lora_a,
        token_slots,
        out,
        num_tokens,
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
) -> torch.Tensor:  # out
    """`kernels.lora.lora_expand_reference`."""
    _check(lora_b, token_slots, out.shape[0])
    num_tokens, n = out.shape
    rank = lora_b.shape[2]
    if sum(piece_rows) != n or len(piece_rows) != shrunk.shape[1] or len(piece_rows) > 3:
        raise ValueError(f"pieces of {piece_rows} rows do not make {n} outputs (at most 3)")
    if lora_b.shape[1] != n or lora_b.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError(f"lora_b {tuple(lora_b.shape)} does not hold {n} output rows")
    if num_tokens == 0:
        return out
    starts = [sum(piece_rows[:i]) for i in range(1, 3)]  # pieces 1 and 2, n where absent
    starts = [start if i + 1 < len(piece_rows) else n for i, start in enumerate(starts)]
    common = math.gcd(*piece_rows)
    block_n = min(128, common & -common)  # a power of two that divides every piece
    block_t = _block_t(num_tokens, rank)
    _lora_expand_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(n, block_n))](
        out,
        shrunk,
        lora_b,
        token_slots,
        num_tokens,
        n,
        starts[0],
        starts[1],
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
