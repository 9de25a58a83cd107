"""Rotary position embeddings: the cos/sin table, with Llama 3's long-context rescaling or
YaRN's (gpt-oss, Qwen3's long context)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with the config's rescaling if given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim // 2]
    if scaling is None:
        return inv_freq
    if scaling.get("rope_type") == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if scaling.get("rope_type") == "linear":  # positions divided by `factor` (Gemma 3)
        return inv_freq / scaling["factor"]
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, scaled)


def _yarn_inv_freq(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN: dimensions that turn more than beta_fast times over the original context keep
    their frequency, those that turn fewer than beta_slow times are slowed by `factor`, and a
    linear ramp blends the dimensions between (its ends rounded outwards unless `truncate`
    is false, as gpt-oss's config says)."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]

    def dimension(rotations: float) -> float:  # the dimension that turns this many times
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.get("beta_fast") or 32), dimension(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_magnitude(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (0.1 ln(factor) + 1 unless
    the config gives it, or its mscale ratio), else 1."""
    if scaling is None or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    factor, weight, all_dim = (scaling["factor"], scaling.get("mscale"),
                               scaling.get("mscale_all_dim"))  # fmt: skip
    if weight and all_dim:
        return mscale(factor, weight) / mscale(factor, all_dim)
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    """The cos/sin table rotary reads by position (`ops.rotary_write_kv` applies it)."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)  # [head_dim // 2]
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        magnitude = rope_magnitude(scaling)
        cache = torch.stack((angles.cos(), angles.sin()), dim=1) * magnitude  # [max_position, 2, D]
        self.register_buffer("cos_sin_cache", cache, persistent=False)
