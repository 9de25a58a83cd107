"""The executor's LoRA adapter slots: --max-loras adapters resident on the device at once.

Every decoder layer's four projections get a pair of tensors in the layout the batched kernels
read (kernels/lora.py): A [slots, pieces, rank, in_features] and B [slots, out_features, rank],
the pieces of a fused projection side by side (q, k, v; gate, up). Filling a slot copies an
adapter in, its rank zero-padded to the slots' rank and its scaling folded into B; a piece the
adapter leaves alone stays zero, so it adds nothing. `SlotTable` decides which adapter sits in
which slot: the adapters a step needs stay, the least recently used one makes room.

Under tensor parallelism a rank's slots hold its part of each adapter, cut as the base layer is
(its `Sharding`): a column-parallel projection keeps A whole and B's rows of its own heads or
columns; a row-parallel one keeps A's columns of its own input and B whole. Each rank then adds
B (A_r x_r) to its partial output, and the all-reduce that sums the partial outputs sums these
to B A x: no collective of its own.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from services.executor.layers.lora import ProjectionSlots
from services.executor.lora.adapter import LoraAdapter, adaptable, projection_shape
from services.executor.parallel.layout import ShardLayout
from services.executor.parallel.shards import Sharding, TensorDims, read

# kvflow's projections and the PEFT modules they fuse, in their output rows' order
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
A_DIMS = TensorDims(rows=None, cols=1)  # A [rank, in_features]
B_DIMS = TensorDims(rows=0, cols=None)  # B [out_features, rank]
MIN_RANK = 16  # the kernels' tl.dot needs 16 along the rank (kernels/triton_lora.py DOT_MIN)


def slot_rank(max_lora_rank: int) -> int:
    """The slots' rank: --max-lora-rank rounded up to a power of two, at least MIN_RANK."""
    return max(MIN_RANK, 1 << (max_lora_rank - 1).bit_length())


class LoraSlots:
    """The device tensors of `max_loras` slots for every layer and projection, of the size of
    this rank's part of them (`layout`)."""

    def __init__(
        self,
        layout: ShardLayout,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {max_loras}")
        self.layout = layout
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.rank = slot_rank(max_lora_rank)
        self.layers: list[dict[str, ProjectionSlots]] = []
        cfg = layout.local_config
        self.shardings = _shardings(layout)
        for index in range(cfg.num_layers):
            layer = {}
            for fused, pieces in FUSED.items():
                if not adaptable(cfg, index, pieces[0]):  # a mixture of experts' MLP
                    continue
                shapes = [projection_shape(cfg, piece) for piece in pieces]
                in_features = shapes[0][1]
                rows = tuple(out for out, _ in shapes)
                a_shape = (max_loras, len(pieces), self.rank, in_features)
                a = torch.zeros(a_shape, dtype=dtype, device=device)
                b = torch.zeros(max_loras, sum(rows), self.rank, dtype=dtype, device=device)
                layer[fused] = ProjectionSlots(a, b, rows)
            self.layers.append(layer)

    def fill(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` into `slot`, replacing what was there."""
        if adapter.rank > self.max_lora_rank:
            raise ValueError(
                f"adapter {adapter.name!r} has rank {adapter.rank} > {self.max_lora_rank}"
            )
        self.clear(slot)
        for (layer, target), (a, b) in adapter.weights.items():
            fused = next(name for name, pieces in FUSED.items() if target in pieces)
            slots = self.layers[layer][fused]
            piece = FUSED[fused].index(target)
            sharding = self.shardings[fused]
            a = read(sharding.cut(a, A_DIMS, piece))
            b = read(sharding.cut(b, B_DIMS, piece))
            start = sum(slots.piece_rows[:piece])
            rows = slots.piece_rows[piece]
            slots.lora_a[slot, piece, : adapter.rank].copy_(a)
            slots.lora_b[slot, start : start + rows, : adapter.rank].copy_(b * adapter.scaling)

    def clear(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is outside 0..{self.max_loras - 1}")
        for layer in self.layers:
            for slots in layer.values():
                slots.lora_a[slot].zero_()
                slots.lora_b[slot].zero_()


def _shardings(layout: ShardLayout) -> dict[str, Sharding]:
    """How the rank holds each projection (as the model's layers do): its adapters' part."""
    cfg = layout.local_config
    columns = cfg.intermediate_size
    return {
        "qkv_proj": layout.qkv_parallel(),
        "o_proj": layout.row_parallel(cfg.hidden_size),
        "gate_up_proj": layout.column_parallel(columns, columns),
        "down_proj": layout.row_parallel(cfg.hidden_size),
    }


class SlotTable:
    """Which adapter is in which slot, least recently used first."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first

    def assign(self, adapters: set[int]) -> tuple[dict[int, int], dict[int, int]]:
        """Slots for the adapters one step needs: (all of them, those that must be filled now).
        Adapters already resident keep their slots; new ones take free slots, then those of the
        least recently used adapters the step does not need. The table counts an adapter as
        resident from here: if filling its slot fails, `forget` it."""
        if len(adapters) > self.max_loras:
            raise ValueError(
                f"a step needs {len(adapters)} adapters but there are {self.max_loras} slots "
                "(--max-loras): the scheduler must not plan that"
            )
        to_fill: dict[int, int] = {}
        free = sorted(set(range(self.max_loras)) - set(self._slots.values()))
        for lora_id in sorted(adapters - set(self._slots)):
            if free:
                slot = free.pop(0)
            else:
                victim = next(i for i in self._slots if i not in adapters)
                slot = self._slots.pop(victim)
            self._slots[lora_id] = slot
            to_fill[lora_id] = slot
        for lora_id in sorted(adapters):
            self._slots.move_to_end(lora_id)  # most recently used last
        return {lora_id: self._slots[lora_id] for lora_id in adapters}, to_fill

    def forget(self, adapter: int) -> int | None:
        """Drop an adapter (unloaded); its slot, now free, or None."""
        return self._slots.pop(adapter, None)

    def resident(self) -> dict[int, int]:
        return dict(self._slots)
