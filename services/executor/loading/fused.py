"""Checkpoints that store a layer's projections fused (Phi-3 and Phi-4: `qkv_proj`,
`gate_up_proj`): each such tensor cut into the pieces the layers load one by one (q, k, v;
gate, up), under the names other families store them by, so that tensor parallelism, FP8 at
load and the fused parameters' checks work as for Llama."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from services.executor.parallel.shards import CheckpointTensor, PackedWeight, read
from shared.model_config import ModelConfig

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def unfused(
    weights: Iterable[tuple[str, CheckpointTensor]], cfg: ModelConfig
) -> Iterator[tuple[str, CheckpointTensor]]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        parent, _, projection = module.rpartition(".")
        if projection not in FUSED:
            yield name, tensor
            continue
        if leaf not in ("weight", "bias") or isinstance(tensor, PackedWeight):
            raise ValueError(f"{name}: fused projections load from float checkpoints only")
        pieces = read(tensor).split(sizes[projection], dim=0)
        for piece, part in zip(FUSED[projection], pieces, strict=True):
            yield f"{parent}.{piece}.{leaf}", part
