"""FP8 experts give the greedy tokens of transformers running the same mixture of experts with
the reference's quantization applied to it: the experts' weights quantized per output row and
dequantized, and each expert's inputs (the token's row, the SiLU-and-mul row) rounded to e4m3
per row (W8A8, as vLLM's FP8 experts); the dense projections W8A8 as in
test_quantized_parity; the router and the lm_head float."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from kvflow import LLM
from tests.integration.test_gpu_parity import hf_greedy_top
from tests.integration.test_parity import hf_greedy
from tests.integration.test_quantized_parity import check_close, fake_fp8, fake_quantize_fp8
from tests.integration.tiny_models import MOE_FAMILIES, TINY, make_prompts


def tiny_moe(family: str) -> torch.nn.Module:
    config_cls, extra = MOE_FAMILIES[family]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config_cls(**{**TINY, **extra}))


def fp8_experts_forward(
    self: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """transformers' experts' forward (Qwen3MoeExperts) with each expert's inputs rounded to
    e4m3 per row."""
    out = torch.zeros_like(hidden)
    for expert in range(self.num_experts):
        token, position = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        gate, up = F.linear(fake_fp8(hidden[token]), self.gate_up_proj[expert]).chunk(2, dim=-1)
        rows = F.linear(fake_fp8(self.act_fn(gate) * up), self.down_proj[expert])
        out.index_add_(0, token, rows * top_k_weights[token, position, None])
    return out


def fake_quantize_experts(model: torch.nn.Module) -> None:
    """Each expert's gate/up and down weights to e4m3 per output row and back, and its
    inputs per row (fp8_experts_forward)."""
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            experts.gate_up_proj.data = fake_fp8(experts.gate_up_proj.data)
            experts.down_proj.data = fake_fp8(experts.down_proj.data)
            experts.forward = types.MethodType(fp8_experts_forward, experts)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe dense first"])
def test_fp8_experts_match_transformers_with_the_reference_quantization(
    family: str, tmp_path: Path
) -> None:
    model = tiny_moe(family)
    model.save_pretrained(tmp_path)
    prompts = make_prompts(model.config.vocab_size)
    plain = hf_greedy(model, prompts, eos_token_id=None)
    fake_quantize_fp8(model)
    fake_quantize_experts(model)
    expected = [hf_greedy_top(model, prompt) for prompt in prompts]
    assert [tokens for tokens, _ in expected] != plain  # the quantization changes the output
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", quantization="fp8")
    check_close(expected, llm, prompts)
    experts = llm.runner.model.layers[1].mlp
    assert experts.experts_gate_up.dtype == torch.float8_e4m3fn
    assert experts.experts_down_scale.shape == (*experts.experts_down.shape[:2], 1)
