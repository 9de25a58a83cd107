"""The GGUF linear method: a GGUF file's weights run as the file stores them (`kernels/gguf.py`)."""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops, quantized_ops
from kernels.gguf import row_bytes
from kernels.lora import LoraDelta
from services.executor.layers.linear import BIAS_DIMS, Activation, Linear, float_input, with_lora
from services.executor.layers.weight_loader import set_weight_loader
from services.executor.parallel.shards import (
    CheckpointTensor,
    PackedWeight,
    TensorDims,
    packed_dims,
    read,
)


class GgufBlocks:
    """A GGUF file's weights as the file holds them (`kernels/gguf.py`), each tensor in its
    own type: a fused projection whose pieces differ in type (Q4_K_M files keep some v_proj
    in Q6_K) runs one kernel per run of rows of one type. Tensors of types without a kernel
    (and F16/F32 ones) are dequantized to the model dtype at load."""

    name = "gguf"
    takes_fp8_rows = False

    def create_weights(self, layer: Linear) -> None:
        # What the checkpoint's weights are handed to (`load_weight`), until `prepare`.
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)

        def load(
            param: nn.Parameter, tensor: CheckpointTensor, shard: int | None, name: str
        ) -> None:
            self.load_weight(layer, tensor, shard, name)

        set_weight_loader(layer.weight, load, len(layer.sharding.pieces))
        layer.packed: dict[int, PackedWeight] = {}  # by first row, until `prepare`
        layer.runs: list[str] = []  # the qtype of buffer qweight{i}, in row order
        # Where the buffers go (the model is built under its dtype and device).
        layer.float_dtype = torch.get_default_dtype()
        layer.device = torch.empty(0).device

    def init_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        raise ValueError("GGUF weights come from a .gguf file; --load-format dummy has none")

    def shard_dims(self, layer: Linear) -> dict[str, TensorDims]:
        # Its weight's pieces come to load_weight, cut by shards.packed_dims.
        return dict(BIAS_DIMS)

    def fp8_input_scale(self, layer: Linear) -> torch.Tensor | None:
        return None

    def load_weight(
        self, layer: Linear, tensor: CheckpointTensor, shard: int | None, name: str
    ) -> None:
        """A checkpoint weight's blocks: the rank's part of piece `shard`, at its rows."""
        if not isinstance(tensor, PackedWeight):
            raise ValueError(f"unexpected weight {name!r}")
        data = read(layer.sharding.cut(tensor.data, packed_dims(tensor.qtype), shard))
        start, rows = layer.sharding.piece_rows(shard)
        if data.shape[0] != rows:
            raise ValueError(f"{name}: checkpoint has {data.shape[0]} rows, not {rows}")
        self.load_shard(layer, start, PackedWeight(tensor.qtype, data))

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
        layer.packed[start] = PackedWeight(weight.qtype, data.to(layer.device, dtype))

    def prepare(self, layer: Linear) -> None:
        starts = sorted(layer.packed)
        shards = [layer.packed[start] for start in starts]
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
        layer.packed = {}
        layer.weight = None  # the placeholder the blocks were handed to

    def apply(self, layer: Linear, x: Activation, lora: LoraDelta | None = None) -> torch.Tensor:
        x = float_input(x, self)
        weights = [getattr(layer, f"qweight{i}") for i in range(len(layer.runs))]
        if len(weights) == 1:
            return with_lora(_gguf_run(x, layer.runs[0], weights[0], layer.bias), lora)
        runs = zip(layer.runs, weights, strict=True)
        out = torch.cat([_gguf_run(x, qtype, w, None) for qtype, w in runs], dim=1)
        return with_lora(out if layer.bias is None else out + layer.bias, lora)

    def apply_gated(self, layer: Linear, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor | None:
        return None  # its kernels take no gated input: the activation runs apart


def _gguf_run(
    x: torch.Tensor, qtype: str, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if qtype == "float":
        return ops.linear(x, weight, bias)
    return quantized_ops.gguf_linear(x, weight, qtype, bias)
