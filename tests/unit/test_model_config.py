"""Model configs: presets have the real shapes, GGUF metadata reads as config.json does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow import LLM, SamplingParams
from shared.model_config import (
    ModelConfig,
    derive_max_model_len,
    embedded_model_path,
    load_model_config,
    resolve_model_source,
)


def num_parameters(cfg: ModelConfig) -> int:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    attention += (q + 2 * kv) if cfg.attention_bias else 0
    attention += 2 * cfg.head_dim if cfg.qk_norm else 0
    dense = 3 * cfg.hidden_size * cfg.intermediate_size
    moe = cfg.moe
    if moe is not None:  # each expert a gated MLP, and the router
        sparse = moe.num_experts * (3 * cfg.hidden_size * moe.intermediate_size + cfg.hidden_size)
        mlps = len(moe.sparse_layers) * sparse + (cfg.num_layers - len(moe.sparse_layers)) * dense
    else:
        mlps = cfg.num_layers * dense
    layer = attention + 2 * cfg.hidden_size
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_layers * layer + mlps + embeddings + cfg.hidden_size


@pytest.mark.parametrize(
    ("preset", "billions"),
    [
        ("Llama-3.1-8B", 8.03),
        ("Qwen3-8B", 8.19),
        ("Qwen2.5-7B", 7.62),
        ("Qwen3-0.6B", 0.596),
        ("Qwen3-30B-A3B", 30.53),
        ("OLMoE-1B-7B-0924", 6.92),
        ("gpt-oss-20b", 20.91),
        ("gemma-3-12b", 11.77),  # the text model of Gemma 3 12B (its image model: 0.4B more)
        ("gemma-2-9b", 9.24),
    ],
)
def test_presets_have_the_published_sizes(preset: str, billions: float) -> None:
    source = resolve_model_source(preset)
    assert source.format == "preset"
    cfg = load_model_config(source)
    assert num_parameters(cfg) / 1e9 == pytest.approx(billions, rel=0.01)


def test_llama31_preset_uses_llama3_rope_and_three_eos_ids() -> None:
    cfg = load_model_config(resolve_model_source("Llama-3.1-8B"))
    assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 8.0
    assert cfg.eos_token_ids == (128001, 128008, 128009)


def test_embedded_gguf_metadata() -> None:
    source = resolve_model_source(None)
    assert source.path == embedded_model_path() and source.is_gguf
    cfg = load_model_config(source)
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)
    assert num_parameters(cfg) / 1e6 == pytest.approx(134.5, rel=0.01)


def test_unknown_model_names_the_presets_and_never_downloads() -> None:
    with pytest.raises(FileNotFoundError, match="never downloads") as error:
        resolve_model_source("meta-llama/Llama-3.1-8B")
    assert "Qwen3-0.6B" in str(error.value)


def test_max_model_len_is_checked_against_the_model() -> None:
    cfg = load_model_config(resolve_model_source("Qwen3-0.6B"))
    assert derive_max_model_len(None, cfg) == 40960
    with pytest.raises(ValueError, match="max-model-len"):
        derive_max_model_len(50000, cfg)


def test_dummy_weights_from_a_config_file(tmp_path: Path) -> None:
    config = {
        "model_type": "qwen3",
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "eos_token_id": 1,
    }
    path = tmp_path / "tiny-qwen3.json"
    path.write_text(json.dumps(config))
    llm = LLM(str(path), load_format="dummy", device="cpu")
    [result] = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(result.token_ids) == 5 and all(0 <= t < 128 for t in result.token_ids)
