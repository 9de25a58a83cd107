"""The dense families beyond Llama and Qwen (Gemma 2 and 3, Phi-3, OLMo 2, Granite) in the
weight formats and adapters Llama runs with, against transformers: FP8 made at load, int4
checkpoints, FP8 checkpoints, and LoRA adapters. Phi-3 stores qkv and gate_up fused: its
quantized checkpoints quantize them whole and its adapters may target them whole, and both are
cut into the pieces the layers load (services/executor/loading/fused.py,
services/executor/lora/adapter.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kvflow import LLM, LoRARequest, SamplingParams
from tests import quantized_writers
from tests.integration.test_int4_parity import WRITERS
from tests.integration.test_parity import hf_greedy, kvflow_greedy
from tests.integration.test_quantized_parity import (
    check_close,
    fake_quantize_fp8,
    fake_quantize_inputs_fp8,
    hf_greedy_top,
)
from tests.integration.tiny_models import TINY_ENGINE, make_prompts, make_tiny_model

peft = pytest.importorskip("peft")

FAMILIES = ["gemma2", "gemma3_text", "phi3", "olmo2", "granite"]


def prompts_of(model: torch.nn.Module) -> list[list[int]]:
    return make_prompts(model.config.vocab_size)[:3]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_made_at_load(family: str, tmp_path: Path) -> None:
    model = make_tiny_model(family)
    model.save_pretrained(tmp_path)
    prompts = prompts_of(model)
    fake_quantize_fp8(model)
    expected = [hf_greedy_top(model, prompt) for prompt in prompts]
    check_close(expected, LLM(str(tmp_path), quantization="fp8", **TINY_ENGINE), prompts)


CHECKPOINTS = [(family, "gptq-g32-act-order") for family in FAMILIES] + [
    ("phi3", fmt) for fmt in ("awq-g32", "ct-g32-asym")
]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "fmt"), CHECKPOINTS)
def test_int4_checkpoints(family: str, fmt: str, tmp_path: Path) -> None:
    model = make_tiny_model(family)
    prompts = prompts_of(model)
    WRITERS[fmt](model, tmp_path)  # the model now holds the dequantized weights
    expected = hf_greedy(model, prompts, eos_token_id=None)
    assert kvflow_greedy(LLM(str(tmp_path), **TINY_ENGINE), prompts, ignore_eos=True) == expected


@pytest.mark.slow
@pytest.mark.parametrize("per_tensor", [False, True], ids=["ct-channel", "fp8-tensor"])
def test_fp8_checkpoints_of_fused_projections(per_tensor: bool, tmp_path: Path) -> None:
    """Phi-3's fused qkv and gate_up quantized whole (one scale per tensor for all of qkv),
    each piece keeping its rows' scales."""
    model = make_tiny_model("phi3")
    prompts = prompts_of(model)
    quantized_writers.write_fp8(model, tmp_path, per_tensor)
    fake_quantize_inputs_fp8(model)
    expected = [hf_greedy_top(model, prompt) for prompt in prompts]
    check_close(expected, LLM(str(tmp_path), **TINY_ENGINE), prompts)


TARGETS = {
    "gemma2": ["q_proj", "v_proj", "down_proj"],
    "gemma3_text": ["k_proj", "o_proj", "gate_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # fused, as published
    "olmo2": ["q_proj", "k_proj", "o_proj", "up_proj"],
    "granite": ["q_proj", "gate_proj", "down_proj"],
}


def last_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapters(family: str, tmp_path: Path) -> None:
    """The first token's top logprobs under the adapter equal the PEFT model's (tiny Gemmas
    echo their last token whatever the adapter: greedy tokens alone would not tell)."""
    base = make_tiny_model(family)
    base.save_pretrained(tmp_path / "base")
    prompts = prompts_of(base)
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    config = peft.LoraConfig(
        init_lora_weights=False, r=8, lora_alpha=32, target_modules=TARGETS[family]
    )
    adapted = peft.get_peft_model(model, config).eval()
    adapted.save_pretrained(str(tmp_path / "adapter"))
    llm = LLM(str(tmp_path / "base"), enable_lora=True, max_lora_rank=8, **TINY_ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    adapter = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    moved = 0.0
    results = llm.generate(prompts, params, lora_request=adapter)
    for prompt, result in zip(prompts, results, strict=True):
        top = result.outputs[0].logprobs[0].top
        ids = torch.tensor([entry.token_id for entry in top])
        got = torch.tensor([entry.logprob for entry in top])
        want = last_logprobs(adapted, prompt)[ids]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        moved = max(moved, float((last_logprobs(base, prompt)[ids] - want).abs().max()))
    assert moved > 1e-2  # the adapter changes what the base model gives
