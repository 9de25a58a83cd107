"""How a model's layers share the KV cache: in groups of equal size, each group a window (its
layers slide) or none (full attention), one block table per group.

A block holds the KV of one layer from each slot: the cache has one tensor per slot (the
layers of a group), and layer l reads and writes its slot's tensor with its group's block
table. Groups of sliding layers then give back the blocks behind their window
(services/scheduler/kv_cache_manager.py), while the full groups keep every block: a model that
mixes the two (Gemma 2 and 3, gpt-oss) holds a long request's context in a fraction of the
memory one table for all layers would take. One group is the layout without this: every layer
a slot of its own, one table.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from shared.model_config import ModelConfig


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' window (None: full attention)
    layer_groups: tuple[int, ...]  # per layer: its group
    layer_slots: tuple[int, ...]  # per layer: its tensor (its place in its group)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        return max(self.layer_slots) + 1

    def blocks_per_sequence(self, num_tokens: int, block_size: int) -> int:
        """The blocks a request of `num_tokens` holds as it decodes: each full group's for
        all of them, each sliding group's for its window (and the block it writes in)."""
        blocks = -(-num_tokens // block_size)
        return sum(
            blocks if window is None else min(blocks, -(-(window - 1) // block_size) + 1)
            for window in self.windows
        )


def kv_groups(cfg: ModelConfig, split: bool = True) -> KVGroups:
    """The model's groups: one per `num_slots` layers of one kind where `split` (sliding layers
    apart from full ones, each kind's layers in order), else one group of every layer (whose
    window is the model's where every layer slides and `split`)."""
    layers = range(cfg.num_layers)
    sliding = set(cfg.sliding_layers) if cfg.sliding_window is not None else set()
    full = [layer for layer in layers if layer not in sliding]
    if not split or not sliding or not full:
        window = cfg.sliding_window if split and not full else None
        return KVGroups((window,), (0,) * cfg.num_layers, tuple(layers))
    size = gcd(len(full), len(sliding))
    kinds = [(full, None), (sorted(sliding), cfg.sliding_window)]
    windows: list[int | None] = []
    groups, slots = [0] * cfg.num_layers, [0] * cfg.num_layers
    for members, window in kinds:
        for start in range(0, len(members), size):
            for slot, layer in enumerate(members[start : start + size]):
                groups[layer], slots[layer] = len(windows), slot
            windows.append(window)
    return KVGroups(tuple(windows), tuple(groups), tuple(slots))
