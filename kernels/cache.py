"""Writing new keys and values into the paged KV cache."""

from __future__ import annotations

import torch


def write_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int: block_id * block_size + offset, or < 0
    k_scale: float = 1.0,  # an FP8 cache's scales: it stores key / k_scale, value / v_scale
    v_scale: float = 1.0,
) -> None:
    """Write token t's K/V to slot `slot_mapping[t]`; a negative slot marks padding, skipped."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    # NOTE: the boolean mask syncs with the device; fine for a reference, not for the engine.
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    keys = to_cache_dtype(key[keep], key_cache.dtype, k_scale)
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = keys
    values = to_cache_dtype(value[keep], value_cache.dtype, v_scale)
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = values


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as the cache stores it. An FP8 cache holds x / scale in e4m3 (the scale a checkpoint's
    calibration gives, else 1.0, as vLLM keeps it without one), multiplied by the inverse so
    the Triton write rounds alike, and saturated at +-448: e4m3 has no infinity, so torch's
    cast would give NaN. Other caches hold x itself (scales apply to FP8 only)."""
    if dtype == torch.float8_e4m3fn:
        return (x.float() * (1.0 / scale)).clamp(-448.0, 448.0).to(dtype)
    if scale != 1.0:
        raise ValueError(f"KV scales apply to an FP8 cache, not {dtype}")
    return x.to(dtype)
