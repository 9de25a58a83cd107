"""Linear layers and how their weights are stored and multiplied (a linear method).

Every projection of the model is a `Linear` with the method chosen once at load
(`linear_method`): the method registers the parameters a checkpoint fills (`create_weights`:
a float weight [N, K], or packed int4 and its scales), prepares them after loading (`prepare`,
e.g. quantizing a float weight to FP8) and runs each call (`apply`). The model code calls
`layer(x)` and never asks which format it holds.

A method with `takes_fp8_rows` also takes its input already quantized per token
(`kernels.fp8.Fp8Rows`): the norm or activation that feeds such a layer quantizes its output
in the same pass (`services/executor/layers.py`), and the layer skips its own quantization.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

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
from kernels.gguf import row_bytes
from kernels.int4 import CHUNK, PACK
from kernels.lora import LoraDelta
from services.executor.linear_shards import Loaded, TensorDims
from services.executor.lora_slots import LoraTokens, ProjectionSlots
from shared.quant_config import QuantSpec

logger = logging.getLogger(__name__)

Activation = torch.Tensor | Fp8Rows  # what a layer takes: Fp8Rows only if takes_fp8_rows


class LinearMethod(Protocol):
    name: str
    takes_fp8_rows: bool  # apply also takes activations quantized per token (Fp8Rows)

    def create_weights(self, layer: Linear) -> None:
        """Register the parameters a checkpoint fills, under the names it loads."""

    def init_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        """Fill them with random values of a realistic scale (--load-format dummy)."""

    def prepare(self, layer: Linear) -> None:
        """After loading: turn what was loaded into what `apply` reads (in place)."""

    def shard_dims(self, layer: Linear) -> dict[str, TensorDims]:
        """Where each tensor it loads holds output rows and input columns, for tensor
        parallelism (`services/executor/linear_shards.py`)."""

    def fp8_input_scale(self, layer: Linear) -> torch.Tensor | None:
        """With takes_fp8_rows: the static scale [1] its producers quantize by; None: they
        quantize per token (or it takes no FP8 rows)."""

    def apply(self, layer: Linear, x: Activation, lora: LoraDelta | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's (float) dtype, plus what each row's LoRA adapter adds
        (`lora`: fused into the GEMM's epilogue where the kernel can, else added after)."""


class Unquantized:
    """The weight as loaded (bf16 on CUDA): the skinny Triton GEMV for decode, else cuBLAS."""

    name = "unquantized"
    takes_fp8_rows = False

    def create_weights(self, layer: Linear) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features))

    def init_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        for param in (layer.weight, layer.bias):
            if param is not None:
                param.data.copy_(_randn(param, generator).mul_(0.02))

    def prepare(self, layer: Linear) -> None:
        pass

    def shard_dims(self, layer: Linear) -> dict[str, TensorDims]:
        return {"weight": TensorDims(rows=0, cols=1), **_BIAS}

    def fp8_input_scale(self, layer: Linear) -> torch.Tensor | None:
        return None

    def apply(self, layer: Linear, x: Activation, lora: LoraDelta | None = None) -> torch.Tensor:
        return ops.linear(_float(x, self), layer.weight, layer.bias, lora)


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
        return _with_lora(out, lora)


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
        values = _randn(layer.qweight, generator).mul_(100.0).clamp_(-FP8_MAX, FP8_MAX)
        layer.qweight.data.copy_(values.to(FP8))
        layer.weight_scale.data.fill_(0.02 / 100.0)
        if layer.bias is not None:
            layer.bias.data.copy_(_randn(layer.bias, generator).mul_(0.02))

    def prepare(self, layer: Linear) -> None:
        pass

    def shard_dims(self, layer: Linear) -> dict[str, TensorDims]:
        return {"qweight": TensorDims(0, 1), "weight_scale": TensorDims(rows=0), **_BIAS}


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
        return _with_lora(out, lora)


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
        return {"qweight": TensorDims(0, 1), "weight_scale": groups, **_BIAS}

    def apply(self, layer: Linear, x: Activation, lora: LoraDelta | None = None) -> torch.Tensor:
        out = ops.fp8_group_linear(
            _float(x, self),
            layer.qweight,
            layer.weight_scale,
            self.group,
            layer.bias,
            layer.block_scale,
        )
        return _with_lora(out, lora)


class Int4WeightOnly:
    """int4 weights (W4A16) as AWQ, GPTQ and compressed-tensors checkpoints hold them, in the
    one layout of `kernels/int4.py` (services/executor/quantized_checkpoints.py translates them):
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

    def shard_dims(self, layer: Linear) -> dict[str, TensorDims]:
        words = TensorDims(0, 1, (CHUNK, CHUNK // PACK), "chunks of packed words")
        # Per group along K, unless one group spans K (channel-wise) or act-order's g_idx
        # sends a rank's columns to any group: then every rank keeps all of them.
        whole = self.spec.group_size <= 0 or layer.g_idx is not None
        groups = (
            TensorDims(rows=0) if whole else TensorDims(0, 1, (self.spec.group_size, 1), "groups")
        )
        dims = {"qweight": words, "scales": groups, **_BIAS}
        if layer.zeros is not None:
            dims["zeros"] = groups
        if layer.g_idx is not None:
            dims["g_idx"] = TensorDims(rows=None, cols=0)
        return dims

    def fp8_input_scale(self, layer: Linear) -> torch.Tensor | None:
        return None

    def apply(self, layer: Linear, x: Activation, lora: LoraDelta | None = None) -> torch.Tensor:
        out = ops.int4_linear(
            _float(x, self),
            layer.qweight,
            layer.scales,
            layer.zeros,
            self.group_size(layer),
            layer.g_idx,
            layer.bias,
        )
        return _with_lora(out, lora)


@dataclass(frozen=True)
class PackedWeight:
    """A checkpoint weight in a form only its layer's method reads (a GGUF tensor's blocks):
    the loader hands it to `method.load_shard` with the row it starts at in the (fused)
    layer, rather than copying it into a parameter."""

    qtype: str  # a kernels.gguf type, or "float": `data` is the weight itself
    data: Loaded  # [rows, row_bytes] uint8, or [rows, K] float; read once cut for the rank


class GgufBlocks:
    """A GGUF file's weights as the file holds them (`kernels/gguf.py`), each tensor in its
    own type: a fused projection whose pieces differ in type (Q4_K_M files keep some v_proj
    in Q6_K) runs one kernel per run of rows of one type. Tensors of types without a kernel
    (and F16/F32 ones) are dequantized to the model dtype at load."""

    name = "gguf"
    takes_fp8_rows = False

    def create_weights(self, layer: Linear) -> None:
        layer.weight = None
        layer.shards: dict[int, PackedWeight] = {}  # by first row, until `prepare`
        layer.runs: list[str] = []  # the qtype of buffer qweight{i}, in row order
        # Where the buffers go (the model is built under its dtype and device).
        layer.float_dtype = torch.get_default_dtype()
        layer.device = torch.empty(0).device

    def init_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        raise ValueError("GGUF weights come from a .gguf file; --load-format dummy has none")

    def shard_dims(self, layer: Linear) -> dict[str, TensorDims]:
        # Its pieces come to load_shard, cut by linear_shards.packed_dims.
        return dict(_BIAS)

    def fp8_input_scale(self, layer: Linear) -> torch.Tensor | None:
        return None

    def load_shard(self, layer: Linear, start: int, weight: PackedWeight) -> None:
        """Checked and moved to the layer's device as it arrives (so the host never holds
        the whole model); fused pieces are joined in `prepare`."""
        k, data = layer.in_features, weight.data
        width = k if weight.qtype == "float" else row_bytes(weight.qtype, k)
        if data.dim() != 2 or data.shape[1] != width:
            raise ValueError(
                f"a {weight.qtype} GGUF weight of {k} inputs has rows of {width} values "
                f"(bytes), got {tuple(data.shape)}"
            )
        dtype = layer.float_dtype if weight.qtype == "float" else torch.uint8
        layer.shards[start] = PackedWeight(weight.qtype, data.to(layer.device, dtype))

    def prepare(self, layer: Linear) -> None:
        starts = sorted(layer.shards)
        shards = [layer.shards[start] for start in starts]
        ends = [0] + [start + s.data.shape[0] for start, s in zip(starts, shards, strict=True)]
        if ends[-1] != layer.out_features or starts != ends[:-1]:
            raise ValueError(
                f"weights missing from the checkpoint: GGUF rows from {starts} to {ends[1:]} "
                f"of a projection of {layer.out_features} rows"
            )
        runs: list[list[PackedWeight]] = []
        for shard in shards:
            if runs and runs[-1][0].qtype == shard.qtype:
                runs[-1].append(shard)
            else:
                runs.append([shard])
        for i, run in enumerate(runs):
            data = run[0].data if len(run) == 1 else torch.cat([s.data for s in run])
            layer.register_buffer(f"qweight{i}", data)
        layer.runs = [run[0].qtype for run in runs]
        layer.shards = {}

    def apply(self, layer: Linear, x: Activation, lora: LoraDelta | None = None) -> torch.Tensor:
        x = _float(x, self)
        weights = [getattr(layer, f"qweight{i}") for i in range(len(layer.runs))]
        if len(weights) == 1:
            return _with_lora(_gguf_run(x, layer.runs[0], weights[0], layer.bias), lora)
        runs = zip(layer.runs, weights, strict=True)
        out = torch.cat([_gguf_run(x, qtype, w, None) for qtype, w in runs], dim=1)
        return _with_lora(out if layer.bias is None else out + layer.bias, lora)


def _gguf_run(
    x: torch.Tensor, qtype: str, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if qtype == "float":
        return ops.linear(x, weight, bias)
    return ops.gguf_linear(x, weight, qtype, bias)


_BIAS = {"bias": TensorDims(rows=0, added=True)}


def _with_lora(out: torch.Tensor, lora: LoraDelta | None) -> torch.Tensor:
    """out plus the LoRA delta, for kernels that do not add it themselves."""
    return out if lora is None else ops.lora_expand(out, *lora)


def _float(x: Activation, method: LinearMethod) -> torch.Tensor:
    """x as a float activation: only methods with takes_fp8_rows are handed Fp8Rows."""
    if isinstance(x, Fp8Rows):
        raise TypeError(f"the {method.name} linear method does not take FP8-quantized inputs")
    return x


def _randn(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(like.shape, generator=generator, device=like.device, dtype=torch.float32)


def linear_method(spec: QuantSpec | None) -> LinearMethod:
    """The method every projection but the lm_head runs (the lm_head keeps its float weight,
    as vLLM keeps it: it is tied to the embedding in many models, and quantizing it moves
    logits more than any other layer)."""
    if spec is None:
        return Unquantized()
    if spec.fp8_block is not None:
        return Fp8Block(spec.fp8_block)
    if spec.checkpoint_format == "fp8" and spec.static_input:
        return Fp8Static()
    if spec.checkpoint_format == "fp8":
        return Fp8Checkpoint() if spec.from_checkpoint else Fp8Dynamic()
    if spec.method == "gguf":
        return GgufBlocks()
    return Int4WeightOnly(spec)


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
    ) -> None:
        """`whole_in_features`: the input columns of the whole layer when this is a rank's
        part of a row-parallel one (`in_features` of them); act-order int4 scales span all."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.whole_in_features = whole_in_features or in_features
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.method: LinearMethod = method or Unquantized()
        self.method.create_weights(self)

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


def prepare_linear_layers(model: nn.Module, spec: QuantSpec | None) -> None:
    """After loading: let each layer's method prepare its weights (e.g. quantize them)."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    for _, layer in layers:
        layer.method.prepare(layer)
    if spec is not None:
        quantized = sum(1 for name, _ in layers if name != "lm_head")
        logger.info("quantization: %s on %d linear layers (lm_head kept)", spec.label, quantized)
