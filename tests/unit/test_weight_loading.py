"""The walk of a checkpoint into a model (services/executor/loading/weights.py): each tensor goes
to the parameter its name maps to, and what does not fit is refused by name: a tensor no
parameter takes, a parameter some checkpoint tensor never filled, a shape that differs, GGUF
blocks for a layer that reads floats."""

from __future__ import annotations

import pytest
import torch
import transformers

from services.executor.loading.weights import load_weights
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.parallel.shards import PackedWeight
from shared.model_config import from_hf_dict
from tests.integration.tiny_models import TINY


def checkpoint() -> tuple[dict[str, torch.Tensor], DecoderForCausalLM]:
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(**TINY)
    state = transformers.LlamaForCausalLM(hf_config).state_dict()
    cfg = from_hf_dict(hf_config.to_dict() | {"model_type": "llama"})
    return state, DecoderForCausalLM(cfg, 64)


def test_every_tensor_lands_in_its_piece_of_the_fused_parameter() -> None:
    state, model = checkpoint()
    load_weights(model, state.items())
    qkv = model.layers[1].self_attn.qkv_proj.weight
    q, k, v = (state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(qkv, torch.cat([q, k, v]))
    gate_up = model.layers[0].mlp.gate_up_proj.weight
    gate, up = (state[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(gate_up, torch.cat([gate, up]))
    assert torch.equal(model.norm.weight, state["model.norm.weight"])


def test_a_tensor_no_parameter_takes_is_refused() -> None:
    state, model = checkpoint()
    state["model.layers.0.self_attn.x_proj.weight"] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.self_attn\.x_"):
        load_weights(model, state.items())


def test_a_missing_piece_of_a_fused_parameter_is_refused() -> None:
    state, model = checkpoint()
    del state["model.layers.1.self_attn.k_proj.weight"]
    missing = r"weights missing from the checkpoint: \['layers\.1\.self_attn\.qkv_proj\.weight'\]"
    with pytest.raises(ValueError, match=missing):
        load_weights(model, state.items())


def test_a_shape_that_differs_is_refused() -> None:
    state, model = checkpoint()
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(128, 32)
    shapes = r"model\.layers\.0\.mlp\.up_proj\.weight: checkpoint shape \(128, 32\) != \(128, 64\)"
    with pytest.raises(ValueError, match=shapes):
        load_weights(model, state.items())


def test_gguf_blocks_for_a_float_layer_are_refused() -> None:
    state, model = checkpoint()
    blocks = PackedWeight("Q8_0", torch.zeros(64, 68, dtype=torch.uint8))
    weights = [*state.items(), ("model.layers.0.self_attn.o_proj.weight", blocks)]
    with pytest.raises(ValueError, match=r"unexpected weight '.*o_proj\.weight' \(Q8_0\)"):
        load_weights(model, weights)
