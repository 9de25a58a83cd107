"""FP8 linear methods: weights quantized at load (W8A8 dynamic), as FP8 checkpoints hold
them (per-tensor or per-channel scales, static input scales), and block-scaled
(`kernels/fp8.py`)."""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from kernels.fp8 import (
    FP8,
    FP8_MAX,
    Fp8Rows,
    aligned_block_scales,
    quantize_fp8_rowwise_reference,
)
from kernels.lora import LoraDelta
from services.executor.layers.linear import (
    BIAS_DIMS,
    Activation,
    Linear,
    Unquantized,
    float_input,
    randn_like,
    with_lora,
)
from services.executor.parallel.shards import TensorDims


class Fp8Dynamic(Unquantized):
    """FP8 e4m3 W8A8: the float weight quantized at load with a scale per output channel, the
    activation per token (by its producer, or here; `kernels/fp8.py`). Half the bytes of bf16
    per step."""

    name = "fp8"
    takes_fp8_rows = True

    def prepare(self, layer: Linear) -> None:
        qweight, scale = quantize_fp8_rowwise_reference(layer.weight.data)  # [N, K], [N, 1]
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("weight_scale", scale[:, 0].contiguous())
        del layer.weight  # the float copy: its memory goes back to the allocator
        layer.register_parameter("weight", None)

    def apply(self, layer: Linear, x: Activation, lora: LoraDelta | None = None) -> torch.Tensor:
        out = ops.fp8_linear(x, layer.qweight, layer.weight_scale, layer.bias)
        return with_lora(out, lora)


class Fp8Checkpoint(Fp8Dynamic):
    """FP8 W8A8 weights as an FP8 checkpoint holds them (services/executor/
    quantized_checkpoints.py turns a scale per tensor into one per output channel); the
    activations are quantized per token, as with Fp8Dynamic."""

    def create_weights(self, layer: Linear) -> None:
        n, k = layer.out_features, layer.in_features
        layer.weight = None
        layer.qweight = nn.Parameter(torch.empty(n, k, dtype=FP8), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)

    def init_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        values = randn_like(layer.qweight, generator).mul_(100.0).clamp_(-FP8_MAX, FP8_MAX)
        layer.qweight.data.copy_(values.to(FP8))
        layer.weight_scale.data.fill_(0.02 / 100.0)
        if layer.bias is not None:
            layer.bias.data.copy_(randn_like(layer.bias, generator).mul_(0.02))

    def prepare(self, layer: Linear) -> None:
        pass

    def shard_dims(self, layer: Linear) -> dict[str, TensorDims]:
        return {"qweight": TensorDims(0, 1), "weight_scale": TensorDims(rows=0), **BIAS_DIMS}


class Fp8Static(Fp8Checkpoint):
    """FP8 W8A8 with static activation scales: each layer's input is scaled by the scale the
    checkpoint calibrated for it (input_scale, per tensor) instead of its own maximum, so no
    pass over it comes first. A fused projection's pieces share their input: the largest of
    their scales is used, so that no piece's calibrated range is clipped (their calibrations
    saw the same inputs, so the scales agree in practice)."""

    takes_fp8_rows = True  # quantized by their producers with this layer's scale

    def create_weights(self, layer: Linear) -> None:
        super().create_weights(layer)
        # One per output row, as the loader expands it: fused pieces fill their own rows.
        scale = torch.empty(layer.out_features, dtype=torch.float32)
        layer.input_scale = nn.Parameter(scale, requires_grad=False)

    def init_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        super().init_dummy(layer, generator)
        layer.input_scale.data.fill_(8.0 / FP8_MAX)  # inputs up to 8 in magnitude

    def shard_dims(self, layer: Linear) -> dict[str, TensorDims]:
        return {**super().shard_dims(layer), "input_scale": TensorDims(rows=0)}

    def prepare(self, layer: Linear) -> None:
        scale = layer.input_scale.data.max().reshape(1)
        if not 0.0 < float(scale) < float("inf"):
            raise ValueError(f"input_scale must be positive and finite, got {float(scale)}")
        del layer.input_scale
        layer.register_buffer("input_scale", scale)

    def fp8_input_scale(self, layer: Linear) -> torch.Tensor | None:
        return layer.input_scale

    def apply(self, layer: Linear, x: Activation, lora: LoraDelta | None = None) -> torch.Tensor:
        # Rows from a producer are quantized by this scale already; o_proj's input is not.
        scale = None if isinstance(x, Fp8Rows) else layer.input_scale
        out = ops.fp8_linear(x, layer.qweight, layer.weight_scale, layer.bias, scale)
        return with_lora(out, lora)


class Fp8Block(Fp8Checkpoint):
    """Block-scaled FP8 W8A8 (`kernels/fp8.py`): a scale per output row and group of input
    columns (the checkpoint's per-block scales, expanded over the block's rows), activations
    quantized per token and group at each call."""

    takes_fp8_rows = False  # its activations are quantized per group, not per token

    def __init__(self, block: tuple[int, int]) -> None:
        self.rows, self.group = block

    def create_weights(self, layer: Linear) -> None:
        n, k = layer.out_features, layer.in_features
        if k % self.group:
            raise ValueError(f"block-scaled FP8 needs K divisible by {self.group}, got {k}")
        layer.weight = None
        layer.qweight = nn.Parameter(torch.empty(n, k, dtype=FP8), requires_grad=False)
        scale = torch.empty(n, k // self.group, dtype=torch.float32)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def prepare(self, layer: Linear) -> None:
        # cuBLASLt's blockwise-scaled GEMM (past 16 rows) takes one scale per 128 x 128 block:
        # kept beside the per-row copy where cuBLASLt takes the layer and its blocks line up
        # (fused pieces of whole blocks); elsewhere the Triton kernel runs every row count.
        layer.block_scale = None  # [ceil(N / 128), K / 128]
        k = layer.in_features
        if (self.rows, self.group) == (128, 128) and ops.blockwise_scaled_mm_supported(
            layer.qweight.device, k
        ):
            layer.block_scale = aligned_block_scales(layer.weight_scale.data, 128)

    def shard_dims(self, layer: Linear) -> dict[str, TensorDims]:
        groups = TensorDims(0, 1, (self.group, 1), "scale groups")
        return {"qweight": TensorDims(0, 1), "weight_scale": groups, **BIAS_DIMS}

    def apply(self, layer: Linear, x: Activation, lora: LoraDelta | None = None) -> torch.Tensor:
        out = ops.fp8_group_linear(
            float_input(x, self),
            layer.qweight,
            layer.weight_scale,
            self.group,
            layer.bias,
            layer.block_scale,
        )
        return with_lora(out, lora)
