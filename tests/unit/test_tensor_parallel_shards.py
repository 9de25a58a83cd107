"""What one rank of a tensor-parallel model loads, without a process group (nothing here runs
a forward pass): each projection's rows or columns, the embedding's vocabulary rows, the KV
head it shares when there are fewer than ranks, and everything else whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from services.executor.loading.safetensors import iter_safetensor_slices
from services.executor.loading.weights import load_weights
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.parallel.tensor_parallel import TensorParallel
from shared.model_config import from_hf_dict
from tests.integration.tiny_models import TINY


def checkpoint(**changes: object) -> tuple[dict[str, torch.Tensor], object]:
    torch.manual_seed(0)
    # Qwen2: biases on q, k and v; tied embeddings
    hf_config = transformers.Qwen2Config(**TINY | {"tie_word_embeddings": True} | changes)
    state = transformers.Qwen2ForCausalLM(hf_config).state_dict()
    cfg = from_hf_dict(hf_config.to_dict() | {"model_type": "qwen2"})
    for key in [k for k in state if k.endswith("k_proj.weight")]:  # older FP8 KV scale names
        state[key.replace("weight", "output_scale")] = torch.tensor(0.5)
        state[key.replace("k_proj.weight", "v_proj.output_scale")] = torch.tensor(0.25)
    return state, cfg


def rank_model(cfg: object, state: dict[str, torch.Tensor], rank: int, world: int):
    model = DecoderForCausalLM(cfg, 64, kv_scales=True, tp=TensorParallel(rank, world))  # type: ignore[arg-type]
    load_weights(model, state.items())
    return model


@pytest.mark.parametrize(("kv_heads", "world"), [(2, 2), (1, 2)], ids=["own-kv", "shared-kv"])
def test_a_rank_loads_its_part(kv_heads: int, world: int) -> None:
    state, cfg = checkpoint(num_key_value_heads=kv_heads)
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    for rank in range(world):
        model = rank_model(cfg, state, rank, world)
        attn = model.layers[0].self_attn
        q_rows = TINY["num_attention_heads"] // world * head_dim
        k_head = rank * kv_heads // world if kv_heads < world else rank
        k_rows = slice(k_head * head_dim, (k_head + 1) * head_dim)
        want_qkv = torch.cat([
            state["model.layers.0.self_attn.q_proj.weight"][rank * q_rows : (rank + 1) * q_rows],
            state["model.layers.0.self_attn.k_proj.weight"][k_rows],
            state["model.layers.0.self_attn.v_proj.weight"][k_rows],
        ])  # fmt: skip
        assert torch.equal(attn.qkv_proj.weight, want_qkv)
        bias = state["model.layers.0.self_attn.k_proj.bias"][k_rows]
        assert torch.equal(attn.qkv_proj.bias[q_rows : q_rows + head_dim], bias)
        o_cols = slice(rank * q_rows, (rank + 1) * q_rows)
        o_weight = state["model.layers.0.self_attn.o_proj.weight"][:, o_cols]
        assert torch.equal(attn.o_proj.weight, o_weight)
        inter = TINY["intermediate_size"] // world
        down = state["model.layers.0.mlp.down_proj.weight"][:, rank * inter : (rank + 1) * inter]
        assert torch.equal(model.layers[0].mlp.down_proj.weight, down)
        vocab = TINY["vocab_size"] // world
        rows = state["model.embed_tokens.weight"][rank * vocab : (rank + 1) * vocab]
        assert torch.equal(model.embed_tokens.weight, rows)
        assert model.lm_head.weight is model.embed_tokens.weight  # tied: the same rows
        norm = state["model.layers.0.input_layernorm.weight"]
        assert torch.equal(model.layers[0].input_layernorm.weight, norm)  # whole
        assert (float(attn.k_scale), float(attn.v_scale)) == (0.5, 0.25)  # whole


@pytest.mark.parametrize(("kv_heads", "world"), [(2, 2), (1, 2)], ids=["own-kv", "shared-kv"])
def test_a_rank_reading_slices_of_the_file_loads_what_it_loads_from_whole_tensors(
    tmp_path: Path, kv_heads: int, world: int
) -> None:
    state, cfg = checkpoint(num_key_value_heads=kv_heads)
    save_file({k: v.clone() for k, v in state.items()}, tmp_path / "model.safetensors")
    for rank in range(world):
        whole = rank_model(cfg, state, rank, world).state_dict()
        model = DecoderForCausalLM(cfg, 64, kv_scales=True, tp=TensorParallel(rank, world))  # type: ignore[arg-type]
        load_weights(model, iter_safetensor_slices(tmp_path))
        sliced = model.state_dict()
        assert sliced.keys() == whole.keys()
        for name, tensor in whole.items():
            assert torch.equal(sliced[name], tensor), name


def test_a_checkpoint_slice_reads_the_part_asked_for(tmp_path: Path) -> None:
    tensor = torch.arange(24.0).reshape(4, 6)
    save_file({"w": tensor}, tmp_path / "model.safetensors")
    ((name, part),) = list(iter_safetensor_slices(tmp_path))
    assert name == "w" and part.shape == (4, 6)
    assert torch.equal(part.narrow(0, 1, 2), tensor[1:3])
    assert torch.equal(part.narrow(1, 4, 2), tensor[:, 4:])
    assert torch.equal(part.read(), tensor)
