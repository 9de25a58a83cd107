"""Rotary position embeddings: the cos/sin table, with Llama 3's long-context rescaling,
YaRN's (gpt-oss, Qwen3's long context) or LongRoPE's (Phi-3's 128k models).

LongRoPE has two sets of frequencies: short ones for sequences within the original context,
long ones past it. transformers computes a sequence longer than the original context with the
long set throughout: a prompt in one pass, and a sequence that grows past it is computed
again from its start with the long set (its cache dropped) on the step that crosses. kvflow
does the same: its scheduler marks a request long (`NewRequestData.long_rope`) once it is
longer than the original context, computing it again from its start when it crosses
(services/scheduler/scheduler.py), and the table holds both sets, the long after the short
(`long_offset` rows on), a long request's positions offset into the long half
(services/executor/runner/step_buffers.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class LongRope:
    """LongRoPE's two sets in one table (the module docstring): `offset`, the long set's first
    row."""

    offset: int

    def rotary_positions(self, positions: np.ndarray, long: np.ndarray) -> np.ndarray:
        """Each token's row of the table ([T] each: its position, whether its request is
        long)."""
        return positions + self.offset * long


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
    if scaling.get("rope_type") == "longrope":  # the short set (RotaryEmbedding adds the long)
        return factored_inv_freq(head_dim, theta, scaling["short_factor"])
    if scaling.get("rope_type") == "factors":  # a GGUF file's rope_freqs (Llama 3's, computed)
        return factored_inv_freq(head_dim, theta, scaling["factors"])
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


def factored_inv_freq(head_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """Each frequency divided by its own factor (as transformers rounds it: one division of 1
    by the product): one of LongRoPE's sets, or a GGUF file's rope_freqs."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)


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
    the config gives it, or its mscale ratio), LongRoPE's (sqrt(1 + ln(factor) / ln(original
    context)) unless given), else 1."""
    if scaling is None or scaling.get("rope_type") not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling["rope_type"] == "longrope":
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))

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
        magnitude = rope_magnitude(scaling)
        cache = _cos_sin(inv_freq, max_position, magnitude)  # [max_position, 2, D]
        # LongRoPE: the long set's rows after the short's (the module docstring)
        self.long_offset: int | None = None
        if scaling is not None and scaling.get("rope_type") == "longrope":
            long_freq = factored_inv_freq(head_dim, theta, scaling["long_factor"])
            cache = torch.cat([cache, _cos_sin(long_freq, max_position, magnitude)])
            self.long_offset = max_position
        self.register_buffer("cos_sin_cache", cache, persistent=False)


def _cos_sin(inv_freq: torch.Tensor, max_position: int, magnitude: float) -> torch.Tensor:
    """[max_position, 2, head_dim]: cos and sin of each position's angles, times magnitude."""
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
    return torch.stack((angles.cos(), angles.sin()), dim=1) * magnitude
