"""Rotary position embedding (rotate-half layout) in Triton, applied in place to q and k.

Same math as `kernels.rotary`: with half = head_dim // 2, each head's dims (i, i + half) become

    lo' = lo * cos[i]        - hi * sin[i]
    hi' = hi * cos[half + i] + lo * sin[half + i]

with cos/sin read from `cos_sin_cache[position]`, computed in float32 and stored in the input
dtype (the reference rounds cos/sin to the input dtype first, so bf16 differs by about an ulp).

One program rotates one token's block of query heads and the same block of key heads, so the
token's cos/sin row is read once for both. It works in place on the q/k views into the fused qkv
output (strided over tokens and heads, head dims contiguous): no copy, no new allocation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TILE_ELEMENTS = 2048  # heads per program: about this many (head, pair) elements


@triton.jit
def _rotate_heads(
    x_ptr,  # one token's [num_heads, head_dim], heads stride_head apart
    stride_head,
    heads,  # [BLOCK_H] head indices of this program
    num_heads,
    dims,  # [BLOCK_HALF]
    dim_ok,  # [BLOCK_HALF]
    half,
    cos_lo,
    cos_hi,
    sin_lo,
    sin_hi,  # each [BLOCK_HALF] float32
):
    mask = (heads < num_heads)[:, None] & dim_ok[None, :]  # [BLOCK_H, BLOCK_HALF]
    lo_ptrs = x_ptr + heads[:, None] * stride_head + dims[None, :]
    lo = tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(lo_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    new_lo = lo * cos_lo[None, :] - hi * sin_lo[None, :]
    new_hi = hi * cos_hi[None, :] + lo * sin_hi[None, :]
    tl.store(lo_ptrs, new_lo.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(lo_ptrs + half, new_hi.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T] int32 or int64
    query_ptr,  # [T, H, D]
    key_ptr,  # [T, KV, D]
    cos_sin_ptr,  # [max_position, 2, D] float32
    stride_pos,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cache_pos,
    stride_cache_kind,  # cos -> sin
    num_heads,
    num_kv_heads,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    dim_ok = dims < half
    pos = tl.load(positions_ptr + tok * stride_pos).to(tl.int64)
    cos_ptrs = cos_sin_ptr + pos * stride_cache_pos + dims
    sin_ptrs = cos_ptrs + stride_cache_kind
    # Both halves are read, so any table works, not only one whose halves repeat.
    cos_lo = tl.load(cos_ptrs, mask=dim_ok, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptrs + half, mask=dim_ok, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptrs, mask=dim_ok, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptrs + half, mask=dim_ok, other=0.0).to(tl.float32)
    q_row = query_ptr + tok * stride_q_tok
    _rotate_heads(
        q_row, stride_q_head, heads, num_heads, dims, dim_ok, half, cos_lo, cos_hi, sin_lo, sin_hi
    )
    k_row = key_ptr + tok * stride_k_tok
    _rotate_heads(
        k_row,
        stride_k_head,
        heads,
        num_kv_heads,
        dims,
        dim_ok,
        half,
        cos_lo,
        cos_hi,
        sin_lo,
        sin_hi,
    )


def rotary_embedding(
    positions: torch.Tensor,  # [T] int32 or int64
    query: torch.Tensor,  # [T, H, D], rotated in place
    key: torch.Tensor,  # [T, KV, D], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, 2, D] float32: cos and sin, halves repeated
) -> tuple[torch.Tensor, torch.Tensor]:  # (query, key): the inputs themselves
    _check_shapes(positions, query, key, cos_sin_cache)
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        # NOTE: head dims that are not contiguous are rotated on copies copied back, which keeps
        # the in-place contract; the model's q/k views always have contiguous head dims.
        q_copy, k_copy = query.contiguous(), key.contiguous()
        rotary_embedding(positions, q_copy, k_copy, cos_sin_cache)
        return query.copy_(q_copy), key.copy_(k_copy)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if num_tokens == 0:
        return query, key
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    max_heads = max(num_heads, num_kv_heads)
    block_h = min(triton.next_power_of_2(max_heads), max(1, _TILE_ELEMENTS // block_half))
    grid = (num_tokens, triton.cdiv(max_heads, block_h))
    _rotary_kernel[grid](
        positions,
        query,
        key,
        cache,
        positions.stride(0),
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cache.stride(0),
        cache.stride(1),
        num_heads,
        num_kv_heads,
        half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=min(max(block_h * block_half // 512, 1), 8),
    )
    return query, key


def _check_shapes(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    if query.dim() != 3 or key.dim() != 3 or positions.dim() != 1:
        raise ValueError("expected positions [T], query [T, H, D] and key [T, KV, D]")
    num_tokens, _, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim or positions.shape[0] != num_tokens:
        raise ValueError(
            f"positions {tuple(positions.shape)}, query {tuple(query.shape)} and key "
            f"{tuple(key.shape)} disagree on tokens or head_dim"
        )
    if head_dim % 2 or cos_sin_cache.dim() != 3 or cos_sin_cache.shape[1:] != (2, head_dim):
        raise ValueError(
            f"cos_sin_cache {tuple(cos_sin_cache.shape)} must be [max_position, 2, {head_dim}] "
            "with an even head_dim"
        )
