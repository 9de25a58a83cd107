"""A decoder layer's mixture of experts (shared/model_config.MoeConfig): the router (`gate`) and
every expert's gate/up and down projections, stacked by expert as the kernels read them, and
Qwen2-MoE's shared expert with its gate.

A checkpoint stores each expert's projections apart (`experts.3.gate_proj.weight`, Mixtral's
`experts.3.w1.weight`); each is one piece of a stacked parameter (`expert_piece`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kernels import ops
from services.executor.layers.linear import Linear
from services.executor.layers.mlp import GatedMLP
from services.executor.layers.weight_loader import copy_weight, set_weight_loader, unpacked
from services.executor.parallel.layout import ShardLayout
from services.executor.parallel.shards import (
    CheckpointTensor,
    Split,
    TensorDims,
    read,
    shard_tensor,
)

# A checkpoint's expert projection -> (our stacked parameter, its piece within the expert's rows)
EXPERT_PROJECTIONS = {
    "gate_proj": ("experts_gate_up", 0),
    "up_proj": ("experts_gate_up", 1),
    "down_proj": ("experts_down", 0),
    "w1": ("experts_gate_up", 0),  # Mixtral's names
    "w3": ("experts_gate_up", 1),
    "w2": ("experts_down", 0),
}


class SparseMoE(nn.Module):
    def __init__(self, layout: ShardLayout) -> None:
        """`layout`: what this rank holds: every expert, each by its part of the columns (as a
        dense MLP is split), and the router whole. Each rank routes alike (x is whole on all)
        and returns its part of the sum, which the next norm adds up over the ranks, as a
        dense MLP's."""
        super().__init__()
        moe = layout.local_config.moe
        assert moe is not None, "a SparseMoE's model has experts"
        hidden_size = layout.local_config.hidden_size
        experts, columns = moe.num_experts, moe.intermediate_size
        self.moe = moe
        self.gate = Linear(hidden_size, experts)  # the router, in the model's dtype
        self.experts_gate_up = nn.Parameter(
            torch.empty(experts, 2 * columns, hidden_size), requires_grad=False
        )
        self.experts_down = nn.Parameter(
            torch.empty(experts, hidden_size, columns), requires_grad=False
        )
        rank = functools.partial(_load_expert_piece, part=layout.tp.rank, parts=layout.tp.size)
        set_weight_loader(self.experts_gate_up, rank, 2 * experts)
        set_weight_loader(self.experts_down, rank, experts)
        self.shared_expert: GatedMLP | None = None
        if moe.shared_expert_size:
            self.shared_expert = GatedMLP(layout, columns=moe.shared_expert_size)
            self.shared_expert_gate = Linear(hidden_size, 1)  # whole: it scales each part

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, ids = ops.moe_route(self.gate(x), self.moe.top_k, self.moe.renormalize)
        out = ops.moe_experts(x, self.experts_gate_up, self.experts_down, weights, ids)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out  # this rank's part


def expert_piece(name: str) -> tuple[str, int] | None:
    """A checkpoint name (no "model." prefix) of an expert's projection -> (our parameter,
    the piece it fills: expert * pieces + its piece), or None if it is not one."""
    parts = name.split(".")
    if len(parts) != 7 or parts[3] != "experts" or parts[6] != "weight":
        return None  # layers.N.{mlp,block_sparse_moe}.experts.E.PROJ.weight
    if parts[5] not in EXPERT_PROJECTIONS or not parts[4].isdigit():
        return None
    param, piece = EXPERT_PROJECTIONS[parts[5]]
    pieces = 2 if param == "experts_gate_up" else 1
    return f"layers.{parts[1]}.mlp.{param}", int(parts[4]) * pieces + piece


def _load_expert_piece(
    param: nn.Parameter,
    tensor: CheckpointTensor,
    shard: int | None,
    name: str,
    part: int = 0,
    parts: int = 1,
) -> None:
    """Piece `shard` of a stacked expert parameter: its expert's rows, the gate's or the up's
    half of them in experts_gate_up; of the checkpoint's tensor, part `part` of `parts` of
    the expert's columns (gate and up: their rows; down: its input columns)."""
    pieces = int(getattr(param, "num_shards", 1)) // param.shape[0]  # a stacked expert's
    expert, piece = divmod(shard or 0, pieces)
    rows = param.shape[1] // pieces
    split: Split = "rows" if pieces == 2 else "cols"
    cut = shard_tensor(unpacked(tensor, name), TensorDims(0, 1), split, part, parts)
    copy_weight(param.data[expert].narrow(0, piece * rows, rows), read(cut), name)
