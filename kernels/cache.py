"""Writing new keys and values into the paged KV cache."""

from __future__ import annotations

import torch


def write_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int: block_id * block_size + offset, or < 0
) -> None:
    """Write token t's K/V to slot `slot_mapping[t]`; a negative slot marks padding, skipped."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    # NOTE: the boolean mask syncs with the device; fine for a reference, not for the engine.
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = to_cache_dtype(key[keep], key_cache.dtype)
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = to_cache_dtype(
        value[keep], value_cache.dtype
    )


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it. An FP8 cache (e4m3, scale 1.0, as vLLM keeps it without
    calibrated scales) saturates at +-448: e4m3 has no infinity, so torch's cast would give NaN.
    """
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-448.0, 448.0).to(dtype)
    return x.to(dtype)
