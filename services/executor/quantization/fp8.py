"""FP8 linear methods: weights quantized at load (W8A8 dynamic), as FP8 checkpoints hold
them (per-tensor or per-channel scales, static input scales), and block-scaled
(`kernels/fp8.py`)."""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops, quantized_ops
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
from services.executor.layers.moe import SparseMoE
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
        out = quantized_ops.fp8_linear(x, layer.qweight, layer.weight_scale, layer.bias)
        return with_lora(out, lora)

    def apply_gated(self, layer: Linear, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor | None:
        return None  # no float weight: its input comes quantized (silu_and_mul_fp8) or apart


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
        out = quantized_ops.fp8_linear(x, layer.qweight, layer.weight_scale, layer.bias, scale)
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
        if (self.rows, self.group) == (128, 128) and quantized_ops.blockwise_scaled_mm_supported(
            layer.qweight.device, k
        ):
            layer.block_scale = aligned_block_scales(layer.weight_scale.data, 128)

    def shard_dims(self, layer: Linear) -> dict[str, TensorDims]:
        groups = TensorDims(0, 1, (self.group, 1), "scale groups")
        return {"qweight": TensorDims(0, 1), "weight_scale": groups, **BIAS_DIMS}

    def apply(self, layer: Linear, x: Activation, lora: LoraDelta | None = None) -> torch.Tensor:
        out = quantized_ops.fp8_group_linear(
            float_input(x, self),
            layer.qweight,
            layer.weight_scale,
            self.group,
            layer.bias,
            layer.block_scale,
        )
        return with_lora(out, lora)


class Fp8Experts:
    """FP8 experts, W8A8 (kernels/moe.py): e4m3 with a float32 scale per output row, or per
    row and `group` input columns, as an FP8 checkpoint stores them (its per-block scales one
    per row, services/executor/quantization/checkpoints.py), or quantized per row at load."""

    name = "fp8"

    def __init__(self, from_checkpoint: bool, group: int | None = None) -> None:
        self.from_checkpoint, self.group = from_checkpoint, group

    def create_weights(self, moe: SparseMoE, hidden: int, columns: int) -> None:
        stored = FP8 if self.from_checkpoint else None
        moe.stack("experts_gate_up", 2 * columns, hidden, stored, TensorDims(0, 1))
        moe.stack("experts_down", hidden, columns, stored, TensorDims(0, 1))
        if not self.from_checkpoint:  # until `prepare` quantizes the float experts
            moe.experts_gate_up_scale = moe.experts_down_scale = None
        else:
            scales = TensorDims(0, 1, (self.group or columns, 1), "scale groups")
            moe.stack("experts_gate_up_scale", 2 * columns, self._groups(hidden),
                      torch.float32, scales)  # fmt: skip
            moe.stack("experts_down_scale", hidden, self._groups(columns), torch.float32, scales)

    def _groups(self, columns: int) -> int:
        """Scales a row of `columns` input columns has."""
        if self.group is None:
            return 1
        if columns % self.group:
            raise ValueError(f"FP8 experts: {columns} input columns are not groups of {self.group}")
        return columns // self.group

    def init_dummy(self, moe: SparseMoE, generator: torch.Generator) -> None:
        """As a checkpoint's: FP8 values across e4m3's range, scaled to ~0.02."""
        for weight, scale in ((moe.experts_gate_up, moe.experts_gate_up_scale),
                              (moe.experts_down, moe.experts_down_scale)):  # fmt: skip
            values = randn_like(weight, generator)
            if scale is None:  # quantized at load
                weight.data.copy_(values.mul_(0.02))
                continue
            weight.data.copy_(values.mul_(100.0).clamp_(-FP8_MAX, FP8_MAX).to(FP8))
            scale.data.fill_(0.02 / 100.0)

    def prepare(self, moe: SparseMoE) -> None:
        """Experts to be quantized at load become FP8, expert by expert (one expert's float32
        copy at a time)."""
        if self.from_checkpoint:
            return
        for name in ("experts_gate_up", "experts_down"):
            weight = getattr(moe, name).data
            q = torch.empty_like(weight, dtype=FP8)
            scale = torch.empty(*weight.shape[:2], 1, dtype=torch.float32, device=weight.device)
            for expert in range(weight.shape[0]):
                q[expert], scale[expert] = quantize_fp8_rowwise_reference(weight[expert])
            delattr(moe, name)  # the float copy goes back to the allocator
            delattr(moe, f"{name}_scale")  # None until now
            moe.register_buffer(name, q)
            moe.register_buffer(f"{name}_scale", scale)

    def apply(
        self, moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        return ops.moe_experts(
            x, moe.experts_gate_up, moe.experts_down, weights, ids,
            moe.experts_gate_up_scale, moe.experts_down_scale, moe.biases, moe.swiglu,
            moe.moe.num_experts,
        )  # fmt: skip
