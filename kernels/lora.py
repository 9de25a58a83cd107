"""Batched LoRA for a step that mixes adapters (Punica's and S-LoRA's shrink and expand): every
token goes through the adapter in its slot, or none.

    x            [T, K]        the projection's input, one row per token
    lora_a       [S, P, R, K]  each slot's A for each piece of a fused projection (q, k, v or
                               gate, up; P = 1 otherwise), rank zero-padded to R
    lora_b       [S, N, R]     each slot's B, rows as the fused projection's output, times the
                               adapter's scaling
    token_slots  [T] int32     each token's slot; -1: the base model alone

    shrink:  y[t, p] = lora_a[slot[t], p] @ x[t]                                 [T, P, R]
    expand:  out[t, rows of piece p] += lora_b[slot[t], rows of p] @ y[t, p]     [T, N]

A piece an adapter leaves alone has zeros in its slot. The Triton kernels (kernels/
triton_lora.py) take the same arguments.
"""

from __future__ import annotations

import torch


def lora_shrink_reference(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, P, R, K]
    token_slots: torch.Tensor,  # [T] int32, -1: none
) -> torch.Tensor:  # [T, P, R] float32
    num_pieces, rank = lora_a.shape[1], lora_a.shape[2]
    out = torch.zeros(x.shape[0], num_pieces, rank, dtype=torch.float32, device=x.device)
    adapted = token_slots >= 0
    a = lora_a[token_slots[adapted].long()].float()  # [T', P, R, K]
    out[adapted] = torch.einsum("tk,tprk->tpr", x[adapted].float(), a)
    return out


def lora_expand_reference(
    out: torch.Tensor,  # [T, N], added to in place
    shrunk: torch.Tensor,  # [T, P, R] float32
    lora_b: torch.Tensor,  # [S, N, R]
    token_slots: torch.Tensor,  # [T] int32, -1: none
    piece_rows: tuple[int, ...],  # output rows of each piece, summing to N
) -> torch.Tensor:  # out
    if sum(piece_rows) != out.shape[1] or len(piece_rows) != shrunk.shape[1]:
        raise ValueError(f"pieces of {piece_rows} rows do not make {out.shape[1]} outputs")
    adapted = token_slots >= 0
    b = lora_b[token_slots[adapted].long()].float()  # [T', N, R]
    delta = torch.empty(int(adapted.sum()), out.shape[1], dtype=torch.float32, device=out.device)
    start = 0
    for piece, rows in enumerate(piece_rows):
        y = shrunk[adapted, piece]  # [T', R]
        delta[:, start : start + rows] = torch.einsum("tr,tnr->tn", y, b[:, start : start + rows])
        start += rows
    out[adapted] = (out[adapted].float() + delta).to(out.dtype)
    return out
