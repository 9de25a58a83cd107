"""Rotary position embedding (rotate-half layout), applied to q and k."""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary_embedding_reference(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, 2, head_dim]: cos and sin, halves repeated
) -> tuple[torch.Tensor, torch.Tensor]:
    cos_sin = cos_sin_cache[positions]  # [num_tokens, 2, head_dim]
    cos = cos_sin[:, None, 0].to(query.dtype)  # [num_tokens, 1, head_dim]
    sin = cos_sin[:, None, 1].to(query.dtype)  # [num_tokens, 1, head_dim]
    return _rotate(query, cos, sin), _rotate(key, cos, sin)
