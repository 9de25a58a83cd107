"""Per-head q/k RMSNorm (optional), rotary embedding and the KV-cache write, as one step.

The reference composes the three references the decoder otherwise calls one after another:
`rms_norm_reference` on each head (Qwen3's q_norm / k_norm), `rotary_embedding_reference`,
then `write_kv_reference` of the rotated key and the value.
"""

from __future__ import annotations

import torch

from kernels.cache import write_kv_reference
from kernels.norm import rms_norm_reference
from kernels.rotary import rotary_embedding_reference


def rotary_write_kv_reference(
    positions: torch.Tensor,  # [num_tokens] int
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, 2, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written
    slot_mapping: torch.Tensor,  # [num_tokens] int: block_id * block_size + offset, or < 0
    q_norm_weight: torch.Tensor | None = None,  # [head_dim]
    k_norm_weight: torch.Tensor | None = None,  # [head_dim]
    eps: float = 1e-6,
    k_scale: float = 1.0,  # an FP8 cache's scales (kernels/cache.py)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]: the rotated query, a new tensor
    """Rotated query; the rotated key and the value go to the caches (negative slot: nowhere).

    The key is not returned: attention reads it back from the cache.
    """
    # The norms' outputs are cast back to the inputs' dtypes (a float32 weight would promote
    # them), as the fused kernel stores the query in place, in its own dtype.
    if q_norm_weight is not None:
        query = rms_norm_reference(query, q_norm_weight, eps).to(query.dtype)  # [T, H, D]
    if k_norm_weight is not None:
        key = rms_norm_reference(key, k_norm_weight, eps).to(key.dtype)  # [T, KV, D]
    query, key = rotary_embedding_reference(positions.long(), query, key, cos_sin_cache)
    write_kv_reference(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return query
