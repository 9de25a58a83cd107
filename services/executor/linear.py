"""Linear layers and how their weights are stored and multiplied (a linear method).

Every projection of the model is a `Linear` with the method chosen once at load
(`linear_method`): the method registers the parameters a checkpoint fills (`create_weights`:
a float weight [N, K], or packed int4 and its scales), prepares them after loading (`prepare`,
e.g. quantizing a float weight to FP8) and runs each call (`apply`). The model code calls
`layer(x)` and never asks which format it holds.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from kernels import ops
from kernels.fp8 import FP8, FP8_MAX, quantize_fp8_rowwise_reference
from kernels.int4 import PACK
from shared.quant_config import QuantSpec

logger = logging.getLogger(__name__)


class LinearMethod(Protocol):
    name: str

    def create_weights(self, layer: Linear) -> None:
        """Register the parameters a checkpoint fills, under the names it loads."""

    def init_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        """Fill them with random values of a realistic scale (--load-format dummy)."""

    def prepare(self, layer: Linear) -> None:
        """After loading: turn what was loaded into what `apply` reads (in place)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""


class Unquantized:
    """The weight as loaded (bf16 on CUDA): the skinny Triton GEMV for decode, else cuBLAS."""

    name = "unquantized"

    def create_weights(self, layer: Linear) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features))

    def init_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        for param in (layer.weight, layer.bias):
            if param is not None:
                param.data.copy_(_randn(param, generator).mul_(0.02))

    def prepare(self, layer: Linear) -> None:
        pass

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, layer.weight, layer.bias)


class Fp8Dynamic(Unquantized):
    """FP8 e4m3 W8A8: the float weight quantized at load with a scale per output channel, the
    activation per token at each call (`kernels/fp8.py`). Half the bytes of bf16 per step."""

    name = "fp8"

    def prepare(self, layer: Linear) -> None:
        qweight, scale = quantize_fp8_rowwise_reference(layer.weight.data)  # [N, K], [N, 1]
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("weight_scale", scale[:, 0].contiguous())
        del layer.weight  # the float copy: its memory goes back to the allocator
        layer.register_parameter("weight", None)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_linear(x, layer.qweight, layer.weight_scale, layer.bias)


class Fp8Checkpoint(Fp8Dynamic):
    """FP8 W8A8 weights as an FP8 checkpoint holds them (services/executor/
    quantized_checkpoints.py turns a scale per tensor into one per output channel); the
    activations are quantized per token at each call, as with Fp8Dynamic."""

    def create_weights(self, layer: Linear) -> None:
        n, k = layer.out_features, layer.in_features
        layer.weight = None
        layer.qweight = nn.Parameter(torch.empty(n, k, dtype=FP8), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)

    def init_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        values = _randn(layer.qweight, generator).mul_(100.0).clamp_(-FP8_MAX, FP8_MAX)
        layer.qweight.data.copy_(values.to(FP8))
        layer.weight_scale.data.fill_(0.02 / 100.0)
        if layer.bias is not None:
            layer.bias.data.copy_(_randn(layer.bias, generator).mul_(0.02))

    def prepare(self, layer: Linear) -> None:
        pass


class Int4WeightOnly:
    """int4 weights (W4A16) as AWQ, GPTQ and compressed-tensors checkpoints hold them, in the
    one layout of `kernels/int4.py` (services/executor/quantized_checkpoints.py translates them):
    a quarter of bf16's bytes per step, dequantized in registers."""

    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec
        self.name = spec.method

    def group_size(self, layer: Linear) -> int:
        return self.spec.group_size if self.spec.group_size > 0 else layer.in_features

    def create_weights(self, layer: Linear) -> None:
        n, k = layer.out_features, layer.in_features
        if k % PACK:
            raise ValueError(f"int4 layers need K divisible by {PACK}, got {k}")
        num_groups = -(-k // self.group_size(layer))

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
        layer.scales.data.copy_(_randn(layer.scales, generator).abs_().mul_(0.005).add_(0.002))
        if layer.zeros is not None:
            zeros = torch.randint(6, 11, layer.zeros.shape, generator=generator, device=device)
            layer.zeros.data.copy_(zeros)
        if layer.g_idx is not None:
            k = layer.in_features
            layer.g_idx.data.copy_(torch.arange(k, device=device) // self.group_size(layer))
        if layer.bias is not None:
            layer.bias.data.copy_(_randn(layer.bias, generator).mul_(0.02))

    def prepare(self, layer: Linear) -> None:
        pass

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return ops.int4_linear(
            x,
            layer.qweight,
            layer.scales,
            layer.zeros,
            self.group_size(layer),
            layer.g_idx,
            layer.bias,
        )


def _randn(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(like.shape, generator=generator, device=like.device, dtype=torch.float32)


def linear_method(spec: QuantSpec | None) -> LinearMethod:
    """The method every projection but the lm_head runs (the lm_head keeps its float weight,
    as vLLM keeps it: it is tied to the embedding in many models, and quantizing it moves
    logits more than any other layer)."""
    if spec is None:
        return Unquantized()
    if spec.checkpoint_format == "fp8":
        return Fp8Checkpoint() if spec.from_checkpoint else Fp8Dynamic()
    return Int4WeightOnly(spec)


class Linear(nn.Module):
    """y = x W^T (+ b) by the layer's method, which registers and loads its weights."""

    weight: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.method: LinearMethod = method or Unquantized()
        self.method.create_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        return self.method.apply(self, x)


def prepare_linear_layers(model: nn.Module, spec: QuantSpec | None) -> None:
    """After loading: let each layer's method prepare its weights (e.g. quantize them)."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    for _, layer in layers:
        layer.method.prepare(layer)
    if spec is not None:
        quantized = sum(1 for name, _ in layers if name != "lm_head")
        logger.info("quantization: %s on %d linear layers (lm_head kept)", spec.method, quantized)
