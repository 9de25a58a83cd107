"""Linear layers and how their weights are stored and multiplied (a linear method).

Every projection of the model is a `Linear`: it loads a float weight [N, K] under its Hugging
Face name, then the method chosen once at load (`set_linear_method`) prepares what it
multiplies with (`prepare`, e.g. quantizing the weight) and runs each call (`apply`). The
model code calls `layer(x)` and never asks which format it holds.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from kernels import ops
from kernels.fp8 import quantize_fp8_rowwise_reference

logger = logging.getLogger(__name__)


class LinearMethod(Protocol):
    name: str

    def prepare(self, layer: Linear) -> None:
        """Turn the loaded float weight into what `apply` reads (in place, on its device)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""


class Unquantized:
    """The weight as loaded (bf16 on CUDA): the skinny Triton GEMV for decode, else cuBLAS."""

    name = "unquantized"

    def prepare(self, layer: Linear) -> None:
        pass

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, layer.weight, layer.bias)


class Fp8Dynamic:
    """FP8 e4m3 W8A8: the weight quantized at load with a scale per output channel, the
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


METHODS: dict[str, type[LinearMethod]] = {"fp8": Fp8Dynamic}


class Linear(nn.Module):
    """y = x W^T (+ b) by the layer's method; loads W [N, K] as nn.Linear does."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.method: LinearMethod = Unquantized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        return self.method.apply(self, x)


def set_linear_method(model: nn.Module, quantization: str | None) -> None:
    """Give every projection the method of `--quantization` (None: as loaded) and prepare its
    weights. The lm_head keeps its float weight, as vLLM keeps it: it is tied to the
    embedding in many models, and quantizing it moves logits more than any other layer."""
    if quantization is None:
        return
    method = METHODS[quantization]()
    layers = [m for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"]
    for layer in layers:
        layer.method = method
        method.prepare(layer)
    logger.info("quantization: %s on %d linear layers (lm_head kept)", method.name, len(layers))
