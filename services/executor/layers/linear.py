"""Linear layers and how their weights are stored and multiplied (a linear method).

Every projection of the model is a `Linear` with the method chosen once at load
(`linear_method` in `quantization/methods.py`; the formats' methods live in `quantization/`,
the float one, `Unquantized`, here): the method registers the parameters a checkpoint fills
(`create_weights`: a float weight [N, K], or packed int4 and its scales), prepares them after
loading (`prepare`, e.g. quantizing a float weight to FP8) and runs each call (`apply`). The
model code calls `layer(x)` and never asks which format it holds.

A layer knows how it is split across tensor-parallel ranks and which checkpoint tensors it
fuses (its `Sharding`); each of its parameters carries a `weight_loader` that cuts the rank's
part of a checkpoint tensor and copies it into its piece's rows, by where the method says the
tensor holds rows and columns (`shard_dims`; layers/weight_loader.py).

A method with `takes_fp8_rows` also takes its input already quantized per token
(`kernels.fp8.Fp8Rows`): the norm or activation that feeds such a layer quantizes its output
in the same pass (`layers/norm.py`, `layers/mlp.py`), and the layer skips its own quantization.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from kernels import ops
from kernels.fp8 import Fp8Rows
from kernels.lora import LoraDelta
from services.executor.layers.lora import LoraTokens, ProjectionSlots
from services.executor.layers.weight_loader import set_weight_loader, sharded_loader
from services.executor.parallel.shards import Sharding, TensorDims

Activation = torch.Tensor | Fp8Rows  # what a layer takes: Fp8Rows only if takes_fp8_rows


class LinearMethod(Protocol):
    name: str
    takes_fp8_rows: bool  # apply also takes activations quantized per token (Fp8Rows)

    def create_weights(self, layer: Linear) -> None:
        """Register the parameters a checkpoint fills, under the names it loads (those that
        `shard_dims` does not name set their own `weight_loader`)."""

    def init_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        """Fill them with random values of a realistic scale (--load-format dummy)."""

    def prepare(self, layer: Linear) -> None:
        """After loading: turn what was loaded into what `apply` reads (in place)."""

    def shard_dims(self, layer: Linear) -> dict[str, TensorDims]:
        """Where each tensor it loads holds output rows and input columns, for tensor
        parallelism (`services/executor/parallel/shards.py`)."""

    def fp8_input_scale(self, layer: Linear) -> torch.Tensor | None:
        """With takes_fp8_rows: the static scale [1] its producers quantize by; None: they
        quantize per token (or it takes no FP8 rows)."""

    def apply(self, layer: Linear, x: Activation, lora: LoraDelta | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's (float) dtype, plus what each row's LoRA adapter adds
        (`lora`: fused into the GEMM's epilogue where the kernel can, else added after)."""

    def apply_gated(self, layer: Linear, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor | None:
        """The layer on act(gate) * up of a gated MLP's gate_up [M, 2K] (act: gelu_tanh with
        `gelu`, else silu), no LoRA: where its kernel makes that input as it loads it (a
        launch less a layer at decode). None: it has no such kernel, and the caller runs
        the activation apart."""


class Unquantized:
    """The weight as loaded (bf16 on CUDA): the skinny Triton GEMV for decode, else cuBLAS."""

    name = "unquantized"
    takes_fp8_rows = False

    def create_weights(self, layer: Linear) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features))

    def init_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        for param in (layer.weight, layer.bias):
            if param is not None:
                param.data.copy_(randn_like(param, generator).mul_(0.02))

    def prepare(self, layer: Linear) -> None:
        pass

    def shard_dims(self, layer: Linear) -> dict[str, TensorDims]:
        return {"weight": TensorDims(rows=0, cols=1), **BIAS_DIMS}

    def fp8_input_scale(self, layer: Linear) -> torch.Tensor | None:
        return None

    def apply(self, layer: Linear, x: Activation, lora: LoraDelta | None = None) -> torch.Tensor:
        return ops.linear(float_input(x, self), layer.weight, layer.bias, lora)

    def apply_gated(self, layer: Linear, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor | None:
        return ops.gated_linear(gate_up, layer.weight, layer.bias, gelu)


BIAS_DIMS = {"bias": TensorDims(rows=0, added=True)}


def with_lora(out: torch.Tensor, lora: LoraDelta | None) -> torch.Tensor:
    """out plus the LoRA delta, for kernels that do not add it themselves."""
    return out if lora is None else ops.lora_expand(out, *lora)


def float_input(x: Activation, method: LinearMethod) -> torch.Tensor:
    """x as a float activation: only methods with takes_fp8_rows are handed Fp8Rows."""
    if isinstance(x, Fp8Rows):
        raise TypeError(f"the {method.name} linear method does not take FP8-quantized inputs")
    return x


def randn_like(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(like.shape, generator=generator, device=like.device, dtype=torch.float32)


class Linear(nn.Module):
    """y = x W^T (+ b) by the layer's method, which registers and loads its weights; with LoRA
    slots attached (`lora`), plus each token's adapter's B A x (`kernels/lora.py`)."""

    weight: nn.Parameter | None
    lora: ProjectionSlots | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        method: LinearMethod | None = None,
        whole_in_features: int | None = None,
        sharding: Sharding | None = None,
    ) -> None:
        """`sharding`: this rank's part of the layer and the checkpoint tensors fused in it
        (None: one, held whole). `whole_in_features`: the input columns of the whole layer
        when this is a rank's part of a row-parallel one (`in_features` of them; by default
        from `sharding`); act-order int4 scales span all."""
        super().__init__()
        self.sharding = sharding or Sharding.whole(out_features)
        if self.sharding.rows != out_features:
            raise ValueError(f"pieces of {self.sharding.rows} rows do not make {out_features}")
        self.in_features, self.out_features = in_features, out_features
        parts = self.sharding.pieces[0].parts if self.sharding.split == "cols" else 1
        self.whole_in_features = whole_in_features or in_features * parts
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.method: LinearMethod = method or Unquantized()
        self.method.create_weights(self)
        self._set_weight_loaders()

    def _set_weight_loaders(self) -> None:
        """Each parameter's loader, by where the method says its tensors hold rows and
        columns (a parameter the method loads itself has its own)."""
        dims = self.method.shard_dims(self)
        for name, param in self.named_parameters(recurse=False):
            if name in dims:
                loader = sharded_loader(self.sharding, dims[name])
                set_weight_loader(param, loader, len(self.sharding.pieces))
            elif not hasattr(param, "weight_loader"):
                raise TypeError(f"the {self.method.name} method loads no {name}")

    def forward(self, x: Activation, lora: LoraTokens | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N]; `lora`: the rows' LoRA slots, when the model runs with LoRA."""
        if lora is None or self.lora is None:
            return self.method.apply(self, x)
        assert isinstance(x, torch.Tensor)  # with slots attached, no producer quantizes
        shrunk = ops.lora_shrink(x, self.lora.lora_a, *lora)  # [KS, M, P, R]
        delta = LoraDelta(shrunk, self.lora.lora_b, lora.slots, self.lora.piece_rows, lora.order)
        return self.method.apply(self, x, delta)

    def fp8_input_scale(self) -> torch.Tensor | None:
        """The static scale the op feeding it quantizes by (`LinearMethod.fp8_input_scale`)."""
        return self.method.fp8_input_scale(self)
