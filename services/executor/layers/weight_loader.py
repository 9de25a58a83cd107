"""How a parameter receives its checkpoint tensor: the `weight_loader` it carries.

The loader (services/executor/loading/weights.py) only walks the checkpoint: it maps each
tensor's name to a parameter and, in a fused layer, the piece it fills (q, k or v of a
qkv_proj), and calls `param.weight_loader(param, tensor, shard, name)`. The parameter's loader
knows the rest: which part of the tensor this rank holds (its layer's `Sharding`), where that
part goes in the fused parameter, and the format (a GGUF method keeps its blocks until
`prepare`). `name` is the checkpoint's, for the errors. A parameter without a loader takes the
tensor whole (norms, KV cache scales).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from services.executor.parallel.shards import (
    CheckpointTensor,
    Loaded,
    PackedWeight,
    Sharding,
    TensorDims,
    read,
)


class WeightLoader(Protocol):
    def __call__(
        self, param: nn.Parameter, tensor: CheckpointTensor, shard: int | None, name: str
    ) -> None:
        """Load `tensor` (checkpoint name `name`) into `param`: the piece `shard` of a fused
        layer (None: the parameter's one piece)."""


def set_weight_loader(param: nn.Parameter, loader: WeightLoader, num_shards: int = 1) -> None:
    """`num_shards`: how many checkpoint tensors fill the parameter (3 for a fused q/k/v)."""
    # Attributes of the parameter itself, as the loader finds them (vLLM's set_weight_attrs).
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.num_shards = num_shards  # type: ignore[attr-defined]


def weight_loader(param: nn.Parameter) -> WeightLoader:
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


def num_shards(param: nn.Parameter) -> int:
    return int(getattr(param, "num_shards", 1))


def default_weight_loader(
    param: nn.Parameter, tensor: CheckpointTensor, shard: int | None, name: str
) -> None:
    """The tensor whole, as every rank holds it."""
    copy_weight(param.data, read(unpacked(tensor, name)), name)


def sharded_loader(sharding: Sharding, dims: TensorDims) -> WeightLoader:
    """A loader of a layer's parameter that holds its tensors' rows and columns as `dims` says:
    it cuts this rank's part of piece `shard` and copies it into that piece's rows."""

    def load(param: nn.Parameter, tensor: CheckpointTensor, shard: int | None, name: str) -> None:
        part = read(sharding.cut(unpacked(tensor, name), dims, shard))
        if dims.rows is None and shard is not None:  # one for all rows: every piece has it
            _copy_shared(param, part, name)
        elif dims.rows is None:
            copy_weight(param.data, part, name)
        else:
            start, rows = sharding.piece_rows(shard)
            copy_weight(param.data.narrow(dims.rows, start, rows), part, name)

    return load


def unpacked(tensor: CheckpointTensor, name: str) -> Loaded:
    """A tensor to copy into a parameter: a packed weight is only its method's to read."""
    if isinstance(tensor, PackedWeight):
        raise ValueError(f"unexpected weight {name!r} ({tensor.qtype})")
    return tensor


def copy_weight(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if target.numel() == tensor.numel() == 1:  # a scalar, stored as [] or [1]
        tensor = tensor.reshape(target.shape)
    if target.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
    target.copy_(tensor)


def _copy_shared(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    """A tensor every piece of a fused layer carries (act-order's g_idx): the first piece's
    copied in, the others' checked against it."""
    if not getattr(param, "shared_loaded", False):
        copy_weight(param.data, tensor, name)
        param.shared_loaded = True  # type: ignore[attr-defined]
    elif not torch.equal(param.data, tensor.to(param.device, param.dtype)):
        raise ValueError(f"{name} differs from the other projections fused with it")
