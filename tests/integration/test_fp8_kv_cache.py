"""`--kv-cache-dtype fp8`: the same memory holds twice the KV blocks (four times in float32),
and the greedy tokens are those of transformers running the same model with its keys and
values rounded to e4m3 (an attention function registered with transformers that rounds them
before its SDPA). As for FP8 weights, last-bit differences may flip a near tie, so a sequence
may leave at one, where each side's token must be among the other's top choices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvflow import LLM
from tests import quantized_writers
from tests.integration.test_gpu_parity import hf_greedy_top
from tests.integration.test_quantized_parity import check_close, fake_quantize_inputs_fp8
from tests.integration.tiny_models import make_prompts, make_tiny_model


def e4m3(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x as an e4m3 cache with this scale holds it (x / scale, saturated), read back."""
    stored = (x.float() * (1.0 / scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (stored.float() * scale).to(x.dtype)


def fp8_kv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: object,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' SDPA attention on keys and values as an e4m3 cache holds them."""
    return sdpa_attention_forward(module, query, e4m3(key), e4m3(value), *args, **kwargs)


AttentionInterface.register("fp8_kv_cache", fp8_kv_attention)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp8_kv_cache_holds_twice_the_blocks_and_keeps_the_tokens(
    family: str, tmp_path: Path
) -> None:
    model = make_tiny_model(family)
    model.save_pretrained(tmp_path)
    prompts = make_prompts(model.config.vocab_size)
    model.set_attn_implementation("fp8_kv_cache")
    expected = [hf_greedy_top(model, prompt) for prompt in prompts]
    memory = {"dtype": "float32", "device": "cpu", "kv_cache_memory_bytes": 2**22}
    plain = LLM(str(tmp_path), **memory)
    fp8 = LLM(str(tmp_path), kv_cache_dtype="fp8", **memory)
    assert fp8.runner.num_blocks == 4 * plain.runner.num_blocks  # float32 -> 1 byte
    assert fp8.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    check_close(expected, fp8, prompts)


# Calibrated scales per layer (keys, values), large enough that the cache holds most values
# as e4m3 subnormals: rounding that differs visibly from an unscaled cache's.
KV_SCALES = {0: (64.0, 128.0), 1: (96.0, 48.0)}


def fp8_scaled_kv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: object,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SDPA on keys and values as an e4m3 cache with the layer's scales holds them."""
    k_scale, v_scale = KV_SCALES[module.layer_idx]  # type: ignore[index]
    key, value = e4m3(key, k_scale), e4m3(value, v_scale)
    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)


AttentionInterface.register("fp8_scaled_kv_cache", fp8_scaled_kv_attention)


def add_kv_scales(folder: Path, old_names: bool = False) -> None:
    """A compressed-tensors checkpoint made an FP8-KV one: kv_cache_scheme, k_scale, v_scale
    (or, as older llm-compressor and AutoFP8 wrote them, k_proj/v_proj.output_scale)."""
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor",
        "dynamic": False,
        "symmetric": True,
    }
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    names = ("k_proj.output_scale", "v_proj.output_scale") if old_names else ("k_scale", "v_scale")
    for layer, scales in KV_SCALES.items():
        for name, scale in zip(names, scales, strict=True):
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor([scale])
    save_file(tensors, folder / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "old_names"), [("llama", False), ("qwen3", False), ("llama", True)]
)
def test_the_checkpoints_kv_scales_are_applied(
    family: str, old_names: bool, tmp_path: Path
) -> None:
    model = make_tiny_model(family)
    prompts = make_prompts(model.config.vocab_size)
    quantized_writers.write_fp8(model, tmp_path, per_tensor=False)  # FP8 weights, per channel
    add_kv_scales(tmp_path, old_names)
    fake_quantize_inputs_fp8(model)
    model.set_attn_implementation("fp8_kv_cache")
    unscaled = [hf_greedy_top(model, prompt)[0] for prompt in prompts]
    model.set_attn_implementation("fp8_scaled_kv_cache")
    expected = [hf_greedy_top(model, prompt) for prompt in prompts]
    # The scales change more sequences than check_close lets differ: an engine that ignored
    # them (and so matched `unscaled`) would fail it.
    changed = sum(tokens != plain for (tokens, _), plain in zip(expected, unscaled, strict=True))
    assert changed >= 3, changed
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_dtype="fp8")
    assert llm.runner.model.layers[1].self_attn.kv_scale_values == KV_SCALES[1]
    check_close(expected, llm, prompts)


def test_dummy_weights_leave_the_kv_scales_at_one(tmp_path: Path) -> None:
    model = make_tiny_model("llama")
    quantized_writers.write_fp8(model, tmp_path, per_tensor=False)
    add_kv_scales(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", load_format="dummy")
    assert all(layer.self_attn.kv_scale_values == (1.0, 1.0) for layer in llm.runner.model.layers)
