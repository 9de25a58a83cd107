"""How a model's pooling and task are read from its files (shared/pooling.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.model_config import ModelSource
from shared.pooling import PoolingConfig, load_pooling_config, resolve_task, shorten
from shared.protocol import ParameterError

ST = "sentence_transformers.models."


def folder_with(
    tmp_path: Path,
    config: dict[str, object],
    modules: list[str] | None = None,
    pooling: dict[str, bool] | None = None,
) -> ModelSource:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if modules is not None:
        paths = {"Pooling": "1_Pooling", "Normalize": "2_Normalize"}
        listed = [{"type": ST + kind, "path": paths.get(kind, "")} for kind in modules]
        (tmp_path / "modules.json").write_text(json.dumps(listed))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return ModelSource(tmp_path, "safetensors", tmp_path.name)


def test_sentence_transformers_modules_name_the_pooling(tmp_path: Path) -> None:
    source = folder_with(
        tmp_path,
        {"architectures": ["Qwen3ForCausalLM"]},
        ["Transformer", "Pooling"],
        {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False},
    )
    assert load_pooling_config(source) == PoolingConfig("mean", normalize=False)
    assert resolve_task("auto", source) == "embed"  # modules.json says so
    assert resolve_task("generate", source) == "generate"  # --task wins


def test_without_modules_a_decoder_pools_its_last_token_normalized(tmp_path: Path) -> None:
    source = folder_with(tmp_path, {"architectures": ["Qwen3Model"], "is_matryoshka": True})
    assert load_pooling_config(source) == PoolingConfig("last", True, matryoshka=True)
    assert resolve_task("auto", source) == "embed"  # a bare ...Model


def test_a_causal_lm_generates_unless_told(tmp_path: Path) -> None:
    source = folder_with(tmp_path, {"architectures": ["LlamaForCausalLM"]})
    assert resolve_task("auto", source) == "generate"
    assert resolve_task("embed", source) == "embed"


def test_two_pooling_modes_are_refused(tmp_path: Path) -> None:
    source = folder_with(
        tmp_path,
        {},
        ["Pooling"],
        {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": True},
    )
    with pytest.raises(ValueError, match="exactly one"):
        load_pooling_config(source)


def test_shorten_renormalizes_only_where_the_model_allows_it() -> None:
    vector = [0.6, 0.8, 0.0, 0.0]
    assert shorten(vector, None, PoolingConfig()) == vector
    assert shorten(vector, 1, PoolingConfig(matryoshka=True)) == [1.0]
    with pytest.raises(ParameterError) as caught:
        shorten(vector, 2, PoolingConfig())
    assert caught.value.param == "dimensions"
    with pytest.raises(ParameterError, match=r"\[1, 4\]"):
        shorten(vector, 5, PoolingConfig(matryoshka=True))
