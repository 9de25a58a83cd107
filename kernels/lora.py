"""Batched LoRA for a step that mixes adapters (Punica's and S-LoRA's shrink and expand): every
token goes through the adapter in its slot, or none.

    x            [T, K]        the projection's input, one row per token
    lora_a       [S, P, R, K]  each slot's A for each piece of a fused projection (q, k, v or
                               gate, up; P = 1 otherwise), rank zero-padded to R
    lora_b       [S, N, R]     each slot's B, rows as the fused projection's output, times the
                               adapter's scaling
    token_slots  [T] int32     each token's slot; -1: the base model alone
    token_order  [T] int32     the tokens grouped by slot, or None: how the kernels take them
                               (any order gives the same result; a grouped one reads each
                               adapter's weights once per block of tokens)

    shrink:  y[s, t, p] = lora_a[slot[t], p, :, cols of split s] @ x[t, cols of s]  [KS, T, P, R]
    expand:  out[t, rows of piece p] += lora_b[slot[t], rows of p] @ sum_s y[s, t, p]    [T, N]

The shrink's result is KS partial sums over KS parts of K, which the expand adds up: a
decode-sized step has too few tokens to keep a GPU busy one program per token, so the kernel
splits K as well (`kernels/triton_lora.py`); the references take K whole (KS = 1). A piece an
adapter leaves alone has zeros in its slot. The Triton kernels take the same arguments.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LoraDelta(NamedTuple):
    """What LoRA adds to a projection's output: its shrink, and the rest of the expand's
    arguments. A linear kernel given one adds it in its epilogue (kernels/triton_linear.py)."""

    shrunk: torch.Tensor  # [KS, T, P, R] float32
    lora_b: torch.Tensor  # [S, N, R]
    token_slots: torch.Tensor  # [T] int32, -1: none
    piece_rows: tuple[int, ...]  # output rows of each piece, summing to N
    token_order: torch.Tensor | None = None  # [T] int32, the tokens grouped by slot


def lora_shrink_reference(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, P, R, K]
    token_slots: torch.Tensor,  # [T] int32, -1: none
    token_order: torch.Tensor | None = None,  # [T] int32: the order changes nothing here
) -> torch.Tensor:  # [1, T, P, R] float32: one part, K whole
    num_pieces, rank = lora_a.shape[1], lora_a.shape[2]
    out = torch.zeros(1, x.shape[0], num_pieces, rank, dtype=torch.float32, device=x.device)
    adapted = token_slots >= 0
    a = lora_a[token_slots[adapted].long()].float()  # [T', P, R, K]
    out[0, adapted] = torch.einsum("tk,tprk->tpr", x[adapted].float(), a)
    return out


def lora_expand_reference(
    out: torch.Tensor,  # [T, N], added to in place
    shrunk: torch.Tensor,  # [KS, T, P, R] float32, partial sums over parts of K
    lora_b: torch.Tensor,  # [S, N, R]
    token_slots: torch.Tensor,  # [T] int32, -1: none
    piece_rows: tuple[int, ...],  # output rows of each piece, summing to N
    token_order: torch.Tensor | None = None,  # [T] int32: the order changes nothing here
) -> torch.Tensor:  # out
    if sum(piece_rows) != out.shape[1] or len(piece_rows) != shrunk.shape[2]:
        raise ValueError(f"pieces of {piece_rows} rows do not make {out.shape[1]} outputs")
    summed = shrunk.sum(dim=0)  # [T, P, R]
    adapted = token_slots >= 0
    b = lora_b[token_slots[adapted].long()].float()  # [T', N, R]
    delta = torch.empty(int(adapted.sum()), out.shape[1], dtype=torch.float32, device=out.device)
    start = 0
    for piece, rows in enumerate(piece_rows):
        y = summed[adapted, piece]  # [T', R]
        delta[:, start : start + rows] = torch.einsum("tr,tnr->tn", y, b[:, start : start + rows])
        start += rows
    out[adapted] = (out[adapted].float() + delta).to(out.dtype)
    return out
