"""A decoder layer's mixture of experts (shared/model_config.MoeConfig): the router (`gate`) and
every expert's gate/up and down projections, stacked by expert as the kernels read them, and
Qwen2-MoE's shared expert with its gate.

A checkpoint stores each expert's projections apart (`experts.3.gate_proj.weight`, Mixtral's
`experts.3.w1.weight`); each is one piece of a stacked parameter (`expert_piece`). How the
experts are stored and run is their `ExpertsMethod`'s: float here, FP8 and int4 in
services/executor/quantization/ (the method is picked from the model's linear method by
quantization/methods.py). The router and the shared expert stay float.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
from torch import nn

from kernels import ops
from kernels.moe import ClampedSwiglu, ExpertBiases
from services.executor.layers.linear import Linear
from services.executor.layers.mlp import GatedMLP
from services.executor.layers.weight_loader import (
    WeightLoader,
    copy_weight,
    set_weight_loader,
    unpacked,
)
from services.executor.parallel.layout import ShardLayout
from services.executor.parallel.shards import (
    CheckpointTensor,
    Split,
    TensorDims,
    read,
    shard_tensor,
)

WHOLE_ROWS = TensorDims(0, 1)  # a stacked projection's rows by output, columns by input

# A checkpoint's expert projection -> (our stacked parameter, its piece within the expert's rows)
EXPERT_PROJECTIONS = {
    "gate_proj": ("experts_gate_up", 0),
    "up_proj": ("experts_gate_up", 1),
    "down_proj": ("experts_down", 0),
    "w1": ("experts_gate_up", 0),  # Mixtral's names
    "w3": ("experts_gate_up", 1),
    "w2": ("experts_down", 0),
}


class ExpertsMethod(Protocol):
    """How a mixture of experts' experts are stored and run (float, FP8, int4), as a linear
    method is for a projection: it registers the stacked parameters (`SparseMoE.stack`),
    fills them with dummy values, prepares them after loading and runs the experts."""

    name: str

    def create_weights(self, moe: SparseMoE, hidden: int, columns: int) -> None: ...

    def init_dummy(self, moe: SparseMoE, generator: torch.Generator) -> None: ...

    def prepare(self, moe: SparseMoE) -> None: ...

    def apply(
        self, moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor: ...


class FloatExperts:
    """Experts in the model's dtype."""

    name = "float"

    def create_weights(self, moe: SparseMoE, hidden: int, columns: int) -> None:
        moe.stack("experts_gate_up", 2 * columns, hidden, None, TensorDims(0, 1))
        moe.stack("experts_down", hidden, columns, None, TensorDims(0, 1))

    def init_dummy(self, moe: SparseMoE, generator: torch.Generator) -> None:
        for weight in (moe.experts_gate_up, moe.experts_down):
            values = torch.randn(weight.shape, generator=generator, device=weight.device)
            weight.data.copy_(values.mul_(0.02))

    def prepare(self, moe: SparseMoE) -> None:
        pass

    def apply(
        self, moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        return ops.moe_experts(
            x, moe.experts_gate_up, moe.experts_down, weights, ids, None, None, moe.biases,
            moe.swiglu, moe.moe.num_experts,
        )  # fmt: skip


class SparseMoE(nn.Module):
    def __init__(self, layout: ShardLayout, method: ExpertsMethod | None = None) -> None:
        """`layout`: what this rank holds: every expert, each by its part of the columns (as a
        dense MLP is split), or with expert parallelism its run of the experts whole; the
        router whole. Each rank routes alike (x is whole on all) and returns its part of the
        sum, which the next norm adds up over the ranks, as a dense MLP's. `method`: how the
        experts are stored (None: float)."""
        super().__init__()
        moe = layout.local_config.moe
        assert moe is not None, "a SparseMoE's model has experts"
        hidden_size = layout.local_config.hidden_size
        self.moe = moe
        self.first_expert = layout.experts.start
        self.num_local_experts = len(layout.experts)
        self.all_experts = self.num_local_experts == moe.num_experts  # else another rank's
        # Expert parallelism across data-parallel replicas: every replica's tokens come here
        # (services/executor/parallel/replica_experts.py)
        self.replicas = layout.tp.replicas if layout.tp.expert_parallel else None
        # The router, whole, in the model dtype
        self.gate = Linear(hidden_size, moe.num_experts, bias=moe.biases)
        # What the rank holds of each expert's columns; with EP its experts whole.
        self.part = (0, 1) if layout.tp.expert_parallel else (layout.tp.rank, layout.tp.size)
        self.method: ExpertsMethod = method or FloatExperts()
        self.method.create_weights(self, hidden_size, moe.intermediate_size)
        self.biases: ExpertBiases | None = None
        if moe.biases:  # gpt-oss's, float whatever the experts' format
            gate_up_bias = self.stack("experts_gate_up_bias", 2 * moe.intermediate_size)
            self.biases = ExpertBiases(gate_up_bias, self.stack("experts_down_bias", hidden_size))
        self.swiglu = (
            ClampedSwiglu(moe.swiglu_limit, moe.swiglu_alpha) if moe.swiglu_limit is not None
            else None
        )  # fmt: skip
        # Each expert's choices by real tokens, every layer's added up (`counts_into`)
        self.counts: torch.Tensor | None = None
        self.shared_expert: GatedMLP | None = None
        if moe.shared_expert_size:
            self.shared_expert = GatedMLP(layout, columns=moe.shared_expert_size)
            self.shared_expert_gate = Linear(hidden_size, 1)  # whole: it scales each part

    def stack(
        self,
        name: str,
        rows: int,
        cols: int | None = None,
        dtype: torch.dtype | None = None,
        dims: TensorDims = WHOLE_ROWS,
        fused_loader: WeightLoader | None = None,
    ) -> nn.Parameter:
        """Register a parameter [local experts, rows(, cols)] that an expert projection's
        checkpoint tensors fill (`name` starts with experts_gate_up, two pieces an expert, or
        experts_down), cut for this rank as `dims` says where its columns lie; from gpt-oss's
        fused tensors where the model has them (`_load_fused`, or `fused_loader` for another
        format, given the same keywords)."""
        shape = (
            (self.num_local_experts, rows) if cols is None else (self.num_local_experts, rows, cols)
        )
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        pieces = 2 if name.startswith("experts_gate_up") else 1
        part, parts = self.part
        where = dict(first=self.first_expert, part=part, parts=parts)
        if self.moe.fused_checkpoint:  # one tensor a layer fills every expert
            load = functools.partial(fused_loader or _load_fused, kind=name, **where)
            set_weight_loader(param, load)
        else:  # each expert's tensors count as loaded (another rank's are skipped): the model's
            load = functools.partial(_load_expert_piece, pieces=pieces, dims=dims, **where)
            set_weight_loader(param, load, pieces * self.moe.num_experts)
        self.register_parameter(name, param)
        return param

    def prepare(self) -> None:
        """After loading (experts quantized at load become FP8 here)."""
        self.method.prepare(self)

    def init_dummy(self, generator: torch.Generator) -> None:
        self.method.init_dummy(self, generator)
        for bias in self.biases or ():
            bias.data.normal_(0.0, 0.02, generator=generator)

    def counts_into(self, counts: torch.Tensor) -> None:
        """From now on each forward pass adds its real tokens' choices to counts [experts]."""
        self.counts = counts

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        slots: torch.Tensor | None = None,  # [T]: the tokens' KV slots (< 0: padding rows)
    ) -> torch.Tensor:  # [T, hidden]
        replicas = self.replicas
        tokens = x if replicas is None else replicas.gather(x)  # every replica's, padded
        if replicas is not None and self.counts is not None and slots is not None:
            own = slots  # other replicas' tokens are counted there
            slots = torch.full((len(tokens),), -1, dtype=own.dtype, device=own.device)
            replicas.own_rows(slots, len(own)).copy_(own)
        weights, ids = ops.moe_route(
            self.gate(tokens), self.moe.top_k, self.moe.renormalize, self.counts, slots
        )
        if not self.all_experts:
            weights, ids = self._local_choices(weights, ids)
        if replicas is not None and (padding := replicas.padding(tokens)) is not None:
            ids = ids.masked_fill(padding.reshape(-1, 1), -1)  # no expert computes them
        out = self.method.apply(self, tokens, weights, ids)  # with self.biases, self.swiglu
        if replicas is not None:
            out = replicas.scatter_sum(out, len(x))
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out  # this rank's part

    def _local_choices(
        self, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With expert parallelism: the choices as this rank's experts, those of other ranks'
        as expert -1, which the kernels skip (reading none of its weights): each rank's part
        of the sum holds its own experts' alone."""
        local = ids - self.first_expert
        mine = (local >= 0) & (local < self.num_local_experts)
        return torch.where(mine, weights, 0.0), torch.where(mine, local, -1)


# A checkpoint expert tensor's last name (as translated, services/executor/quantization/
# checkpoints.py) -> the suffix of the stacked parameter it fills
_EXPERT_PARTS = {
    "weight": "",
    "qweight": "",  # FP8 or packed int4
    "weight_scale": "_scale",  # FP8
    "scales": "_scale",  # int4
    "zeros": "_zeros",  # int4
}


# gpt-oss's fused expert tensors -> our stacked parameters (`_load_fused`; MXFP4's blocks and
# scales, kept as such: services/executor/quantization/mxfp4.py)
_FUSED = {
    "gate_up_proj": "experts_gate_up",
    "gate_up_proj_bias": "experts_gate_up_bias",
    "down_proj": "experts_down",
    "down_proj_bias": "experts_down_bias",
    "gate_up_proj_blocks": "experts_gate_up",
    "gate_up_proj_scales": "experts_gate_up_scale",
    "down_proj_blocks": "experts_down",
    "down_proj_scales": "experts_down_scale",
}


def expert_piece(name: str) -> tuple[str, int | None] | None:
    """A checkpoint name (no "model." prefix) of an expert's projection (its weight, or an FP8
    checkpoint's weight and scales as translated) -> (our parameter, the piece it fills:
    expert * pieces + its piece), or None if it is not one."""
    parts = name.split(".")
    if len(parts) == 5 and parts[3] == "experts":  # layers.N.mlp.experts.gate_up_proj (gpt-oss)
        if parts[4] not in _FUSED:
            raise ValueError(f"{name}: not an expert tensor kvflow reads")
        return f"layers.{parts[1]}.mlp.{_FUSED[parts[4]]}", None
    if len(parts) != 7 or parts[3] != "experts" or parts[6] not in _EXPERT_PARTS:
        return None  # layers.N.{mlp,block_sparse_moe}.experts.E.PROJ.weight
    if parts[5] not in EXPERT_PROJECTIONS or not parts[4].isdigit():
        return None
    param, piece = EXPERT_PROJECTIONS[parts[5]]
    pieces = 2 if param == "experts_gate_up" else 1
    return f"layers.{parts[1]}.mlp.{param}{_EXPERT_PARTS[parts[6]]}", int(parts[4]) * pieces + piece


def _load_expert_piece(
    param: nn.Parameter,
    tensor: CheckpointTensor,
    shard: int | None,
    name: str,
    *,
    first: int,
    pieces: int,
    part: int,
    parts: int,
    dims: TensorDims,
) -> None:
    """Piece `shard` (expert * pieces + piece) of a stacked expert parameter: its expert's
    rows, the gate's or the up's half of them in experts_gate_up, if the rank holds that
    expert (the parameter's are experts first, first + 1, ...); of the checkpoint's tensor,
    part `part` of `parts` of the expert's columns (gate and up: their rows; down: its input
    columns), where `dims` says its columns lie. A scale tensor of one a row, [rows], is
    [rows, 1]."""
    expert, piece = divmod(shard or 0, pieces)
    if not 0 <= expert - first < param.shape[0]:
        return  # another rank's expert
    rows = param.shape[1] // pieces
    split: Split = "rows" if pieces == 2 else "cols"
    tensor = unpacked(tensor, name)
    if len(tensor.shape) == 1:
        dims = TensorDims(rows=0)
    cut = read(shard_tensor(tensor, dims, split, part, parts))
    target = param.data[expert - first].narrow(0, piece * rows, rows)
    copy_weight(target, cut.reshape(rows, -1) if cut.dim() == 1 else cut, name)


def _load_fused(
    param: nn.Parameter,
    tensor: CheckpointTensor,
    shard: int | None,
    name: str,
    *,
    first: int,
    part: int,
    parts: int,
    kind: str,
) -> None:
    """gpt-oss's layer of experts, fused: gate_up_proj [E, in, 2 I] (gate and up columns
    interleaved) and its bias [E, 2 I], down_proj [E, I, out] and its bias [E, out], into the
    rank's experts first, first + 1, ... as the kernels read them (gate rows, then up rows;
    down [E, out, I]), of each its part `part` of `parts` of the I columns; down's bias,
    added once to the ranks' sum, on part 0 alone."""
    experts = param.shape[0]
    whole = read(unpacked(tensor, name).narrow(0, first, experts))  # the rank's experts
    width = whole.shape[-1] // 2 // parts if kind.startswith("experts_gate_up") else 0
    if kind.startswith("experts_gate_up"):  # [n, (in,) 2 I] interleaved -> [n, (in,) 2 I']
        gate, up = (whole[..., h::2][..., part * width : (part + 1) * width] for h in (0, 1))
        value = torch.cat([gate, up], dim=-1)
        value = value.transpose(1, 2) if value.dim() == 3 else value
    elif kind == "experts_down":  # [n, I, out] -> [n, out, I']
        rows = whole.shape[1] // parts
        value = whole[:, part * rows : (part + 1) * rows].transpose(1, 2)
    else:  # experts_down_bias [n, out]
        value = whole if part == 0 else torch.zeros_like(whole)
    copy_weight(param.data, value.contiguous(), name)
