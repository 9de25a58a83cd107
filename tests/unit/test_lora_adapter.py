"""PEFT LoRA adapters read by kvflow: made here with the `peft` package on a tiny Llama, each
adapted projection's delta (scaling * B A) checked against what peft itself merges into the
base weight, and every adapter kvflow cannot run refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")

from services.executor.lora.adapter import (  # noqa: E402
    TARGETS,
    LoraAdapterError,
    load_lora_adapter,
    projection_shape,
)
from shared.model_config import from_hf_dict  # noqa: E402
from tests.integration.tiny_models import TINY  # noqa: E402

MAX_RANK = 16


def base_model(seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()


def save_adapter(folder: Path, seed: int = 1, **lora: object) -> transformers.PreTrainedModel:
    """A PEFT adapter with random A and B (PEFT starts B at zero) saved in `folder`; returns
    the adapted model."""
    options = dict(r=8, lora_alpha=16, target_modules=list(TARGETS), init_lora_weights=False)
    options.update(lora)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base_model(), peft.LoraConfig(**options))
    model.save_pretrained(str(folder))
    return model


def kvflow_config():
    return from_hf_dict(transformers.LlamaConfig(**TINY).to_dict() | {"model_type": "llama"})


def merged_deltas(model: transformers.PreTrainedModel) -> dict[tuple[int, str], torch.Tensor]:
    """What peft's own merge adds to each adapted projection's weight."""
    base = base_model().state_dict()
    merged = model.merge_and_unload().state_dict()
    deltas = {}
    for name, weight in merged.items():
        parts = name.split(".")  # model.layers.<i>.<self_attn|mlp>.<proj>.weight
        if len(parts) == 6 and parts[4] in TARGETS:
            delta = weight - base[name]
            if delta.abs().max() > 0:
                deltas[(int(parts[2]), parts[4])] = delta
    return deltas


@pytest.mark.parametrize(
    ("lora", "targets"),
    [
        ({}, TARGETS),
        ({"target_modules": ["q_proj", "v_proj"], "use_rslora": True}, ("q_proj", "v_proj")),
        ({"r": 16, "lora_alpha": 8}, TARGETS),
        ({"target_modules": r".*\.(o_proj|down_proj)"}, ("o_proj", "down_proj")),
        ({"target_modules": ["gate_proj"], "layers_to_transform": [1]}, ("gate_proj",)),
    ],
    ids=["all-seven", "rslora", "rank-16", "pattern", "one-layer"],
)
def test_deltas_are_what_peft_merges(tmp_path: Path, lora: dict, targets: tuple) -> None:
    model = save_adapter(tmp_path, **lora)
    adapter = load_lora_adapter("tenant-a", tmp_path, kvflow_config(), MAX_RANK)
    assert adapter.targets == targets and adapter.rank == lora.get("r", 8)
    expected = merged_deltas(model)
    assert set(adapter.weights) == set(expected)
    for (layer, target), delta in expected.items():
        torch.testing.assert_close(adapter.delta(layer, target), delta, rtol=1e-4, atol=1e-5)


def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path: Path) -> None:
    save_adapter(tmp_path, r=16, lora_alpha=8, use_rslora=True)
    assert load_lora_adapter("a", tmp_path, kvflow_config(), MAX_RANK).scaling == 8 / 4
    save_adapter(tmp_path, r=16, lora_alpha=8)
    assert load_lora_adapter("a", tmp_path, kvflow_config(), MAX_RANK).scaling == 8 / 16


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"r": 32}, "rank 32 is over --max-lora-rank 16"),
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "trained biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "not LORA"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, r"\['embed_tokens'\] are not among"),
        ({"target_modules": ["q_proj"]}, "do not cover"),  # the file holds all seven
        ({"layers_to_transform": 1}, "do not cover"),  # and every layer
        ({"init_lora_weights": "pissa_niter_4"}, "needs the base model PEFT changed"),
        ({"alora_invocation_tokens": [1, 2]}, "activated LoRA"),
        ({"lora_alpha": "16"}, "lora_alpha must be a number"),
        ({"layers_to_transform": ["first"]}, "cannot read it: ValueError"),  # any type error
    ],
)
def test_adapters_kvflow_cannot_run_are_refused(tmp_path: Path, change: dict, message: str):
    save_adapter(tmp_path)
    edit_config(tmp_path, **change)
    with pytest.raises(LoraAdapterError, match=message):
        load_lora_adapter("bad", tmp_path, kvflow_config(), MAX_RANK)


@pytest.mark.parametrize(
    "change",
    [
        {"target_modules": "all-linear"},  # PEFT saves it expanded; as written, all seven
        {"target_modules": ["model.layers.0.self_attn.q_proj"]},  # dotted: the weights say
        {"layers_to_transform": []},  # PEFT: every layer
        {"exclude_modules": ["model.layers.1.mlp.up_proj"]},  # exclusions: the weights say
    ],
)
def test_configs_peft_writes_other_ways_load(tmp_path: Path, change: dict) -> None:
    save_adapter(tmp_path)
    edit_config(tmp_path, **change)
    adapter = load_lora_adapter("a", tmp_path, kvflow_config(), MAX_RANK)
    assert adapter.targets == TARGETS and len(adapter.weights) == 2 * len(TARGETS)


def test_lora_alpha_defaults_to_peft_s_8(tmp_path: Path) -> None:
    save_adapter(tmp_path, r=4)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    assert load_lora_adapter("a", tmp_path, kvflow_config(), MAX_RANK).scaling == 8 / 4


def rename_tensors(folder: Path, rename) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    save_file({rename(name): tensor for name, tensor in tensors.items()}, str(path))


def test_tensor_names_with_or_without_prefix_and_adapter_name_load(tmp_path: Path) -> None:
    model = save_adapter(tmp_path)
    rename_tensors(tmp_path, lambda n: n.removeprefix("base_model.model."))
    rename_tensors(tmp_path, lambda n: n.replace(".lora_A.weight", ".lora_A.default.weight"))
    adapter = load_lora_adapter("a", tmp_path, kvflow_config(), MAX_RANK)
    for (layer, target), delta in merged_deltas(model).items():
        torch.testing.assert_close(adapter.delta(layer, target), delta, rtol=1e-4, atol=1e-5)


def with_a_second_lora_a(tensors: dict) -> dict:
    """q_proj's A of layer 0 also under an adapter-name segment, as a merged file might."""
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    return tensors | {name.replace(".lora_A.", ".lora_A.x."): tensors[name].clone()}


def without_a_lora_b(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if "layers.1.mlp.down_proj.lora_B" not in k}


def with_an_lm_head(tensors: dict) -> dict:
    return tensors | {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        (with_a_second_lora_a, "two lora_A tensors"),
        (without_a_lora_b, "lacks lora_A or lora_B"),
        (with_an_lm_head, "is not a LoRA weight"),
        (lambda tensors: {}, "holds no LoRA weights"),
    ],
    ids=["duplicate", "missing-b", "lm-head", "empty"],
)
def test_bad_weight_files_are_refused(tmp_path: Path, tensors, message: str) -> None:
    save_adapter(tmp_path)
    path = tmp_path / "adapter_model.safetensors"
    save_file(tensors(load_file(str(path))), str(path))
    with pytest.raises(LoraAdapterError, match=message):
        load_lora_adapter("bad", tmp_path, kvflow_config(), MAX_RANK)


def test_a_config_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    save_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text("[]")
    with pytest.raises(LoraAdapterError, match="not a JSON object"):
        load_lora_adapter("bad", tmp_path, kvflow_config(), MAX_RANK)


def test_an_unreadable_file_is_refused(tmp_path: Path) -> None:
    save_adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoraAdapterError, match="cannot read it"):
        load_lora_adapter("bad", tmp_path, kvflow_config(), MAX_RANK)


def test_an_adapter_for_another_model_is_refused(tmp_path: Path) -> None:
    save_adapter(tmp_path)
    wider = from_hf_dict(
        transformers.LlamaConfig(**TINY | {"hidden_size": 128}).to_dict() | {"model_type": "llama"}
    )
    with pytest.raises(LoraAdapterError, match="an adapter for another model"):
        load_lora_adapter("other", tmp_path, wider, MAX_RANK)


def test_missing_and_pickled_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(LoraAdapterError, match=r"no adapter_config\.json"):
        load_lora_adapter("none", tmp_path, kvflow_config(), MAX_RANK)
    save_adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").rename(tmp_path / "adapter_model.bin")
    with pytest.raises(LoraAdapterError, match="is a pickle, which kvflow never loads"):
        load_lora_adapter("pickled", tmp_path, kvflow_config(), MAX_RANK)


def test_projection_shapes_follow_the_config() -> None:
    cfg = kvflow_config()
    assert projection_shape(cfg, "k_proj") == (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size)
    assert projection_shape(cfg, "down_proj") == (cfg.hidden_size, cfg.intermediate_size)
