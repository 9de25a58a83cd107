"""The int4 weight-only linear method (W4A16): AWQ, GPTQ and compressed-tensors checkpoints
in the one layout of `kernels/int4.py`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels import ops, quantized_ops
from kernels.int4 import CHUNK, PACK, Int4Stack
from kernels.lora import LoraDelta
from services.executor.layers.linear import (
    BIAS_DIMS,
    Activation,
    Linear,
    float_input,
    randn_like,
    with_lora,
)
from services.executor.layers.moe import SparseMoE
from services.executor.parallel.shards import TensorDims
from shared.quant_config import QuantSpec


class Int4WeightOnly:
    """int4 weights (W4A16) as AWQ, GPTQ and compressed-tensors checkpoints hold them, in the
    one layout of `kernels/int4.py` (services/executor/quantization/checkpoints.py translates them):
    a quarter of bf16's bytes per step, dequantized in registers."""

    takes_fp8_rows = False

    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec
        self.name = spec.method

    def group_size(self, layer: Linear) -> int:
        return self.spec.group_size if self.spec.group_size > 0 else layer.in_features

    def create_weights(self, layer: Linear) -> None:
        n, k = layer.out_features, layer.in_features
        # The kernels' layout interleaves words in chunks of CHUNK columns (kernels/int4.py),
        # each inside one group (act-order gathers each column's group instead).
        grouped_words = self.spec.group_size > 0 and not self.spec.act_order
        if k % CHUNK or (grouped_words and self.spec.group_size % CHUNK):
            raise ValueError(
                f"int4 layers need K and the group size divisible by {CHUNK}, got K={k} and "
                f"groups of {self.spec.group_size}"
            )
        # With act-order a rank's columns may fall in any group of the whole layer's.
        grouped = layer.whole_in_features if self.spec.act_order else k
        num_groups = 1 if self.spec.group_size <= 0 else -(-grouped // self.spec.group_size)

        def frozen(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

        layer.weight = None
        layer.qweight = frozen(n, k // PACK, dtype=torch.int32)
        layer.scales = frozen(n, num_groups)
        layer.zeros = None if self.spec.symmetric else frozen(n, num_groups, dtype=torch.uint8)
        layer.g_idx = frozen(k, dtype=torch.int32) if self.spec.act_order else None

    def init_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        # Random 4-bit values, zero points near the middle and scales that give the weights
        # the float dummy's spread (0.02).
        device = layer.qweight.device
        shape = layer.qweight.shape
        bits = torch.randint(-(2**31), 2**31, shape, generator=generator, device=device)
        layer.qweight.data.copy_(bits)
        layer.scales.data.copy_(randn_like(layer.scales, generator).abs_().mul_(0.005).add_(0.002))
        if layer.zeros is not None:
            zeros = torch.randint(6, 11, layer.zeros.shape, generator=generator, device=device)
            layer.zeros.data.copy_(zeros)
        if layer.g_idx is not None:
            k = layer.in_features
            layer.g_idx.data.copy_(torch.arange(k, device=device) // self.group_size(layer))
        if layer.bias is not None:
            layer.bias.data.copy_(randn_like(layer.bias, generator).mul_(0.02))

    def prepare(self, layer: Linear) -> None:
        pass

    def shard_dims(self, layer: Linear) -> dict[str, TensorDims]:
        words = TensorDims(0, 1, (CHUNK, CHUNK // PACK), "chunks of packed words")
        # Per group along K, unless one group spans K (channel-wise) or act-order's g_idx
        # sends a rank's columns to any group: then every rank keeps all of them.
        whole = self.spec.group_size <= 0 or layer.g_idx is not None
        groups = (
            TensorDims(rows=0) if whole else TensorDims(0, 1, (self.spec.group_size, 1), "groups")
        )
        dims = {"qweight": words, "scales": groups, **BIAS_DIMS}
        if layer.zeros is not None:
            dims["zeros"] = groups
        if layer.g_idx is not None:
            dims["g_idx"] = TensorDims(rows=None, cols=0)
        return dims

    def fp8_input_scale(self, layer: Linear) -> torch.Tensor | None:
        return None

    def apply(self, layer: Linear, x: Activation, lora: LoraDelta | None = None) -> torch.Tensor:
        out = quantized_ops.int4_linear(float_input(x, self), *self._weights(layer))
        return with_lora(out, lora)

    def apply_gated(self, layer: Linear, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor | None:
        return None  # its kernels take no gated input: the activation runs apart

    def _weights(self, layer: Linear) -> tuple[Any, ...]:
        """The layer's int4 operands as the kernels take them, after x: qweight, scales, zero
        points, group size, act-order's g_idx, bias."""
        group = self.group_size(layer)
        return layer.qweight, layer.scales, layer.zeros, group, layer.g_idx, layer.bias


class Int4Experts:
    """int4 experts (W4A16) as AWQ, GPTQ and compressed-tensors checkpoints of mixtures of
    experts hold them, expert by expert, in the layout of `kernels/int4.py` stacked by expert
    (`kernels.int4.Int4Stack`): a quarter of bf16's bytes per chosen expert."""

    name = "int4"

    def __init__(self, spec: QuantSpec) -> None:
        if spec.act_order:
            raise ValueError("int4 experts with act-order (desc_act, g_idx) are not supported")
        self.spec = spec

    def group_size(self, columns: int) -> int:
        return self.spec.group_size if self.spec.group_size > 0 else columns

    def create_weights(self, moe: SparseMoE, hidden: int, columns: int) -> None:
        if moe.moe.fused_checkpoint:
            raise ValueError("int4 experts of gpt-oss are not supported (its experts: bf16 or FP8)")
        words = TensorDims(0, 1, (CHUNK, CHUNK // PACK), "chunks of packed words")
        for name, rows, k in (("experts_gate_up", 2 * columns, hidden),
                              ("experts_down", hidden, columns)):  # fmt: skip
            group = self.group_size(k)
            if k % CHUNK or group % CHUNK or k % group:
                raise ValueError(
                    f"int4 experts need input columns and groups in multiples of {CHUNK}, "
                    f"whole groups: {k} columns in groups of {group}"
                )
            # One scale a row: every rank keeps its rows' whole (no column split to follow).
            channel = self.spec.group_size <= 0
            groups = TensorDims(rows=0) if channel else TensorDims(0, 1, (group, 1), "groups")
            moe.stack(name, rows, k // PACK, torch.int32, words)
            moe.stack(f"{name}_scale", rows, k // group, None, groups)
            if not self.spec.symmetric:
                moe.stack(f"{name}_zeros", rows, k // group, torch.uint8, groups)

    def stacks(self, moe: SparseMoE) -> tuple[Int4Stack, Int4Stack]:
        """(gate_up, down) as the kernels read them."""
        return tuple(  # type: ignore[return-value]
            Int4Stack(
                getattr(moe, name), getattr(moe, f"{name}_scale"),
                getattr(moe, f"{name}_zeros", None),
                self.group_size(getattr(moe, name).shape[2] * PACK),
            )
            for name in ("experts_gate_up", "experts_down")
        )  # fmt: skip

    def init_dummy(self, moe: SparseMoE, generator: torch.Generator) -> None:
        """As Int4WeightOnly's: random 4-bit values, zero points near the middle, scales that
        give the weights the float dummy's spread."""
        for stack in self.stacks(moe):
            device = stack.qweight.device
            bits = torch.randint(-(2**31), 2**31, stack.qweight.shape, generator=generator,
                                 device=device)  # fmt: skip
            stack.qweight.data.copy_(bits)
            scales = randn_like(stack.scales, generator).abs_().mul_(0.005).add_(0.002)
            stack.scales.data.copy_(scales)
            if stack.zeros is not None:
                zeros = torch.randint(6, 11, stack.zeros.shape, generator=generator,
                                      device=device)  # fmt: skip
                stack.zeros.data.copy_(zeros)

    def prepare(self, moe: SparseMoE) -> None:
        pass

    def apply(
        self, moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        return ops.moe_experts_int4(
            x, *self.stacks(moe), weights, ids, all_experts=moe.moe.num_experts
        )
