"""A decoder layer's mixture of experts (shared/model_config.MoeConfig): the router (`gate`) and
every expert's gate/up and down projections, stacked by expert as the kernels read them, and
Qwen2-MoE's shared expert with its gate.

A checkpoint stores each expert's projections apart (`experts.3.gate_proj.weight`, Mixtral's
`experts.3.w1.weight`); each is one piece of a stacked parameter (`expert_piece`). FP8 experts
(`ExpertsFp8`) are e4m3 with a float32 scale per output row and group of input columns, read
from an FP8 checkpoint (its per-block scales one per row, services/executor/quantization/
checkpoints.py) or quantized per row at load; the router and the shared expert stay float.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from kernels import ops
from kernels.fp8 import FP8, FP8_MAX, quantize_fp8_rowwise_reference
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


@dataclasses.dataclass(frozen=True)
class ExpertsFp8:
    """How a model's experts are FP8: as the checkpoint stores them (a scale per output row,
    or per row and `group` input columns), or quantized per row at load."""

    from_checkpoint: bool
    group: int | None = None  # input columns a scale spans; None: the whole row


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
    def __init__(self, layout: ShardLayout, fp8: ExpertsFp8 | None = None) -> None:
        """`layout`: what this rank holds: every expert, each by its part of the columns (as a
        dense MLP is split), or with expert parallelism its run of the experts whole; the
        router whole. Each rank routes alike (x is whole on all) and returns its part of the
        sum, which the next norm adds up over the ranks, as a dense MLP's. `fp8`: the
        experts' FP8 format (None: float)."""
        super().__init__()
        moe = layout.local_config.moe
        assert moe is not None, "a SparseMoE's model has experts"
        hidden_size = layout.local_config.hidden_size
        experts, columns = len(layout.experts), moe.intermediate_size
        self.moe, self.fp8 = moe, fp8
        self.first_expert = layout.experts.start
        self.all_experts = experts == moe.num_experts  # else another rank holds some
        self.gate = Linear(hidden_size, moe.num_experts)  # the router, whole, in the model dtype
        stored = FP8 if fp8 is not None and fp8.from_checkpoint else None
        self.experts_gate_up = _stacked(experts, 2 * columns, hidden_size, stored)
        self.experts_down = _stacked(experts, hidden_size, columns, stored)
        part, parts = (0, 1) if layout.tp.expert_parallel else (layout.tp.rank, layout.tp.size)
        load = functools.partial(
            _load_expert_piece, first=self.first_expert, part=part, parts=parts
        )
        # Every expert's tensors count as loaded (another rank's are skipped): the model's.
        gate_up_loader = functools.partial(load, pieces=2)
        set_weight_loader(self.experts_gate_up, gate_up_loader, 2 * moe.num_experts)
        set_weight_loader(self.experts_down, functools.partial(load, pieces=1), moe.num_experts)
        self.experts_gate_up_scale: nn.Parameter | None = None
        self.experts_down_scale: nn.Parameter | None = None
        if stored is not None and fp8 is not None:
            groups = (_groups(hidden_size, fp8.group), _groups(columns, fp8.group))
            self.experts_gate_up_scale = _stacked(experts, 2 * columns, groups[0], torch.float32)
            self.experts_down_scale = _stacked(experts, hidden_size, groups[1], torch.float32)
            set_weight_loader(self.experts_gate_up_scale, gate_up_loader, 2 * moe.num_experts)
            down_loader = functools.partial(load, pieces=1)
            set_weight_loader(self.experts_down_scale, down_loader, moe.num_experts)
        # Each expert's choices by real tokens, every layer's added up (`counts_into`)
        self.counts: torch.Tensor | None = None
        self.shared_expert: GatedMLP | None = None
        if moe.shared_expert_size:
            self.shared_expert = GatedMLP(layout, columns=moe.shared_expert_size)
            self.shared_expert_gate = Linear(hidden_size, 1)  # whole: it scales each part

    def prepare(self) -> None:
        """After loading: experts to be quantized at load become FP8, expert by expert (one
        expert's float32 copy at a time)."""
        if self.fp8 is None or self.fp8.from_checkpoint:
            return
        for name in ("experts_gate_up", "experts_down"):
            weight = getattr(self, name).data
            q = torch.empty_like(weight, dtype=FP8)
            scale = torch.empty(*weight.shape[:2], 1, dtype=torch.float32, device=weight.device)
            for expert in range(weight.shape[0]):
                q[expert], scale[expert] = quantize_fp8_rowwise_reference(weight[expert])
            delattr(self, name)  # the float copy goes back to the allocator
            delattr(self, f"{name}_scale")  # None until now
            self.register_buffer(name, q)
            self.register_buffer(f"{name}_scale", scale)

    def init_dummy(self, generator: torch.Generator) -> None:
        """Random experts as a checkpoint's: FP8 values across e4m3's range, scaled to ~0.02."""
        for weight, scale in ((self.experts_gate_up, self.experts_gate_up_scale),
                              (self.experts_down, self.experts_down_scale)):  # fmt: skip
            values = torch.randn(weight.shape, generator=generator, device=weight.device)
            if scale is None:
                weight.data.copy_(values.mul_(0.02))
                continue
            weight.data.copy_(values.mul_(100.0).clamp_(-FP8_MAX, FP8_MAX).to(FP8))
            scale.data.fill_(0.02 / 100.0)

    def counts_into(self, counts: torch.Tensor) -> None:
        """From now on each forward pass adds its real tokens' choices to counts [experts]."""
        self.counts = counts

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        slots: torch.Tensor | None = None,  # [T]: the tokens' KV slots (< 0: padding rows)
    ) -> torch.Tensor:  # [T, hidden]
        weights, ids = ops.moe_route(
            self.gate(x), self.moe.top_k, self.moe.renormalize, self.counts, slots
        )
        if not self.all_experts:
            weights, ids = self._local_choices(weights, ids)
        out = ops.moe_experts(
            x, self.experts_gate_up, self.experts_down, weights, ids,
            self.experts_gate_up_scale, self.experts_down_scale,
        )  # fmt: skip
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out  # this rank's part

    def _local_choices(
        self, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With expert parallelism: the choices as this rank's experts, those of other ranks'
        weighted 0 (on expert 0 here: the kernels run every pair, and each rank's part of the
        sum holds its own experts' alone)."""
        local = ids - self.first_expert
        mine = (local >= 0) & (local < self.experts_down.shape[0])
        return torch.where(mine, weights, 0.0), torch.where(mine, local, 0)


def _stacked(experts: int, rows: int, cols: int, dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(experts, rows, cols, dtype=dtype), requires_grad=False)


def _groups(columns: int, group: int | None) -> int:
    """Scales a row of `columns` input columns has, a group of `group` each (None: one)."""
    if group is None:
        return 1
    if columns % group:
        raise ValueError(f"FP8 experts: {columns} input columns are not whole groups of {group}")
    return columns // group


# A checkpoint expert tensor's last name -> whether it is a weight's scales
_EXPERT_PARTS = {"weight": False, "qweight": False, "weight_scale": True}


def expert_piece(name: str) -> tuple[str, int] | None:
    """A checkpoint name (no "model." prefix) of an expert's projection (its weight, or an FP8
    checkpoint's weight and scales as translated) -> (our parameter, the piece it fills:
    expert * pieces + its piece), or None if it is not one."""
    parts = name.split(".")
    if len(parts) != 7 or parts[3] != "experts" or parts[6] not in _EXPERT_PARTS:
        return None  # layers.N.{mlp,block_sparse_moe}.experts.E.PROJ.weight
    if parts[5] not in EXPERT_PROJECTIONS or not parts[4].isdigit():
        return None
    param, piece = EXPERT_PROJECTIONS[parts[5]]
    pieces = 2 if param == "experts_gate_up" else 1
    suffix = "_scale" if _EXPERT_PARTS[parts[6]] else ""
    return f"layers.{parts[1]}.mlp.{param}{suffix}", int(parts[4]) * pieces + piece


def _load_expert_piece(
    param: nn.Parameter,
    tensor: CheckpointTensor,
    shard: int | None,
    name: str,
    first: int = 0,
    pieces: int = 1,
    part: int = 0,
    parts: int = 1,
) -> None:
    """Piece `shard` (expert * pieces + piece) of a stacked expert parameter: its expert's
    rows, the gate's or the up's half of them in experts_gate_up, if the rank holds that
    expert (the parameter's are experts first, first + 1, ...); of the checkpoint's tensor,
    part `part` of `parts` of the expert's columns (gate and up: their rows; down: its input
    columns). An FP8 scale tensor, [rows] or [rows, groups], splits the same way, by its
    groups of columns."""
    expert, piece = divmod(shard or 0, pieces)
    if not 0 <= expert - first < param.shape[0]:
        return  # another rank's expert
    rows = param.shape[1] // pieces
    split: Split = "rows" if pieces == 2 else "cols"
    tensor = unpacked(tensor, name)
    dims = TensorDims(0, 1 if len(tensor.shape) == 2 else None, what="scale groups")
    cut = read(shard_tensor(tensor, dims, split, part, parts))
    target = param.data[expert - first].narrow(0, piece * rows, rows)
    copy_weight(target, cut.reshape(rows, -1) if cut.dim() == 1 else cut, name)
