"""Checkpoints that store a layer's projections fused (Phi-3 and Phi-4: `qkv_proj` and
`gate_up_proj` in safetensors, `attn_qkv` and `ffn_up` in GGUF): each such tensor cut into the
pieces the layers load one by one (q, k, v; gate, up), under the names other families store
them by, so that tensor parallelism, FP8 (at load or from the checkpoint), int4 checkpoints and
the fused parameters' checks work as for Llama. A quantized checkpoint's fused module is cut
once translated into the kernels' layout, where every part has a row per output."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from services.executor.parallel.shards import CheckpointTensor, PackedWeight, read
from shared.model_config import ModelConfig

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# A projection's parts with a row per output (a float weight and bias, and a quantized one's
# in the kernels' layout: services/executor/quantization/checkpoints.py), cut with the rows;
# and those per input column, which every piece reads whole.
ROW_PARTS = {"weight", "bias", "qweight", "scales", "zeros", "weight_scale", "input_scale"}
INPUT_PARTS = {"g_idx"}


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
        if leaf in INPUT_PARTS:
            for piece in FUSED[projection]:
                yield f"{parent}.{piece}.{leaf}", tensor
            continue
        if leaf not in ROW_PARTS:
            raise ValueError(f"{name}: a fused projection's {leaf} cannot be cut")
        # A GGUF file's blocks are stored row by row: its rows cut as a float tensor's do.
        stored = tensor.data if isinstance(tensor, PackedWeight) else tensor
        rows = read(stored).split(sizes[projection], dim=0)
        pieces: list[CheckpointTensor] = list(rows)
        if isinstance(tensor, PackedWeight):
            pieces = [PackedWeight(tensor.qtype, cut) for cut in rows]
        for piece, part in zip(FUSED[projection], pieces, strict=True):
            yield f"{parent}.{piece}.{leaf}", part
