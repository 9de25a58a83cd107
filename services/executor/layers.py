"""The building blocks of a decoder layer, calling kernels through `kernels.ops`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kernels import ops
from services.executor.linear import Activation, Linear, LinearMethod
from services.executor.lora_slots import LoraTokens
from services.executor.tensor_parallel import ONE_RANK, TensorParallel


def feeds_fp8_rows(layer: Linear) -> bool:
    """Whether the op feeding this layer quantizes its output for it (`Fp8Rows`): not for a
    layer with LoRA slots, whose adapters multiply the float input."""
    return layer.method.takes_fp8_rows and layer.lora is None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        feeds: Linear | None = None,  # the layer it feeds: an FP8 one takes quantized rows
        reduce: TensorParallel = ONE_RANK,  # x is a rank's part of the sum over this group
    ) -> Activation | tuple[Activation, torch.Tensor]:
        if residual is None:
            return self._norm(reduce.all_reduce(x), feeds)
        w, eps = self.weight, self.eps
        fp8_layer = _fp8_layer(feeds)
        if reduce.size > 1 and fp8_layer is None:
            return reduce.all_reduce_add_rms_norm(x, residual, w, eps)
        x = reduce.all_reduce(x)
        if fp8_layer is None:
            return ops.fused_add_rms_norm(x, residual, w, eps)
        scale = fp8_layer.fp8_input_scale()  # the layer's static scale, or None: per token
        return ops.fused_add_rms_norm_fp8(x, residual, w, eps, scale)

    def begin(
        self, x: torch.Tensor, feeds: Linear | None = None, reduce: TensorParallel = ONE_RANK
    ) -> tuple[Activation, torch.Tensor]:
        """The first norm of the residual stream: (the norm of x, x), with x the embedding
        (with `reduce`, x is a rank's part of it, and the residual stream is the sum)."""
        if reduce.size > 1 and _fp8_layer(feeds) is None:
            return reduce.all_reduce_add_rms_norm(x, None, self.weight, self.eps)
        x = reduce.all_reduce(x)
        return self._norm(x, feeds), x

    def _norm(self, x: torch.Tensor, feeds: Linear | None) -> Activation:
        fp8_layer = _fp8_layer(feeds)
        if fp8_layer is None:
            return ops.rms_norm(x, self.weight, self.eps)
        scale = fp8_layer.fp8_input_scale()  # the layer's static scale, or None: per token
        return ops.rms_norm_fp8(x, self.weight, self.eps, scale)


def _fp8_layer(feeds: Linear | None) -> Linear | None:
    """The layer fed, if it takes its input quantized to FP8 rows."""
    return feeds if feeds is not None and feeds_fp8_rows(feeds) else None


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with Llama 3's long-context rescaling if given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim // 2]
    if scaling is None:
        return inv_freq
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
        cache = torch.stack((angles.cos(), angles.sin()), dim=1)  # [max_position, 2, head_dim]
        self.register_buffer("cos_sin_cache", cache, persistent=False)


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,  # this rank's columns (all of them on one rank)
        method: LinearMethod | None = None,
        tp: TensorParallel = ONE_RANK,
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, method=method)
        whole = intermediate_size * tp.size  # down_proj is row-parallel
        self.down_proj = Linear(
            intermediate_size, hidden_size, method=method, whole_in_features=whole
        )

    def forward(self, x: Activation, lora: LoraTokens | None = None) -> torch.Tensor:
        """`lora`: the tokens' LoRA slots (see Linear.forward), or None."""
        gate_up = self.gate_up_proj(x, lora)  # [T, 2 * intermediate]
        if feeds_fp8_rows(self.down_proj):  # quantized as down_proj would (its static scale)
            scale = self.down_proj.fp8_input_scale()
            out = self.down_proj(ops.silu_and_mul_fp8(gate_up, scale), lora)
        else:
            out = self.down_proj(ops.silu_and_mul(gate_up), lora)  # [T, hidden]
        return out  # this rank's part: the next RMSNorm sums the ranks' (its `reduce`)
