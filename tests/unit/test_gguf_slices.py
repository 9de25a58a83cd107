"""A GGUF tensor read in part (what a tensor-parallel rank reads of the embedded SmolLM2's
file) equals the same part of the tensor read whole: rows, columns of whole blocks (of a
dequantized tensor, any columns), dequantized or kept as stored, llama.cpp's q/k row order
undone per head."""

from __future__ import annotations

import functools

import pytest
import torch

from services.executor.loading.gguf import iter_gguf
from services.executor.parallel.shards import CheckpointSlice, PackedWeight, read
from shared.model_config import ModelConfig, load_model_config, resolve_model_source

SOURCE = resolve_model_source(None)


@functools.cache
def config() -> ModelConfig:
    """Read when a test needs it, not when the module is collected (2 s of GGUF metadata)."""
    return load_model_config(SOURCE)


def tensors(keep_blocks: bool) -> dict[str, CheckpointSlice]:
    loaded = {}
    for name, tensor in iter_gguf(SOURCE.path, config(), keep_blocks):
        loaded[name] = tensor.data if isinstance(tensor, PackedWeight) else tensor
    return {name: t for name, t in loaded.items() if isinstance(t, CheckpointSlice)}


@pytest.mark.parametrize("keep_blocks", [False, True], ids=["dequantized", "blocks"])
def test_a_part_read_alone_is_that_part_of_the_whole(keep_blocks: bool) -> None:
    loaded = tensors(keep_blocks)
    names = [
        "model.embed_tokens.weight",  # Q8_0, cut by vocabulary rows
        "model.layers.0.self_attn.q_proj.weight",  # Q4_1, rows in llama.cpp's order
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.down_proj.weight",  # cut by input columns
    ]
    for name in names:
        lazy = loaded[name]
        whole = read(lazy)
        assert list(whole.shape) == list(lazy.shape), name
        third = whole.shape[0] // 3
        torch.testing.assert_close(lazy.narrow(0, third, third), whole[third : 2 * third])
        if name.endswith("down_proj.weight"):
            width = lazy.shape[1] // 3  # 320 values (10 blocks) or their bytes
            part = lazy.narrow(1, width, width)
            torch.testing.assert_close(part, whole[:, width : 2 * width])


def test_a_dequantized_column_cut_may_fall_inside_a_block() -> None:
    """A rank of a dequantized tensor may cut between any two columns (Q4_K's 256-value blocks
    split 3 ways): it reads the blocks that hold its columns."""
    down = tensors(keep_blocks=False)["model.layers.1.mlp.down_proj.weight"]
    whole = read(down)
    torch.testing.assert_close(down.narrow(1, 16, 40), whole[:, 16:56])
