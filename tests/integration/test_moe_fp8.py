"""FP8 experts give the greedy tokens of transformers running the same mixture of experts with
the reference's quantization applied to it: the experts' weights quantized per output row and
dequantized, and each expert's inputs (the token's row, the SiLU-and-mul row) rounded to e4m3
per row (W8A8, as vLLM's FP8 experts); the dense projections W8A8 as in
test_quantized_parity; the router and the lm_head float."""

from __future__ import annotations

import functools
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from kvflow import LLM
from tests import quantized_writers
from tests.integration.test_gpu_parity import hf_greedy_top
from tests.integration.test_parity import hf_greedy
from tests.integration.test_quantized_parity import (
    check_close,
    fake_fp8,
    fake_fp8_groups,
    fake_quantize_fp8,
    fake_quantize_inputs_fp8,
)
from tests.integration.tiny_models import MOE_FAMILIES, TINY, make_prompts


def tiny_moe(family: str) -> torch.nn.Module:
    config_cls, extra = MOE_FAMILIES[family]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config_cls(**{**TINY, **extra}))


def fp8_experts_forward(
    self: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor, group: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """transformers' experts' forward (Qwen3MoeExperts) with each expert's inputs rounded to
    e4m3 per row (or per row and group of `group` columns)."""
    if group is not None:
        return _grouped_forward(self, hidden, top_k_index, top_k_weights, group)
    out = torch.zeros_like(hidden)
    for expert in range(self.num_experts):
        token, position = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        gate, up = F.linear(fake_fp8(hidden[token]), self.gate_up_proj[expert]).chunk(2, dim=-1)
        rows = F.linear(fake_fp8(self.act_fn(gate) * up), self.down_proj[expert])
        out.index_add_(0, token, rows * top_k_weights[token, position, None])
    return out


def _grouped_forward(
    self: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor, group: int,
) -> torch.Tensor:  # fmt: skip
    out = torch.zeros_like(hidden)
    for expert in range(self.num_experts):
        token, position = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        x = fake_fp8_groups(hidden[token], group)
        gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
        rows = F.linear(fake_fp8_groups(self.act_fn(gate) * up, group), self.down_proj[expert])
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


def write_fp8_experts(model: torch.nn.Module, folder: Path, block: int) -> None:
    """The checkpoint's experts (written fused by the dense writer) as an FP8 checkpoint
    publishes them: each expert's projections apart, e4m3 with `weight_scale_inv` per
    [block, block] block (transformers' `quant_method: fp8`); the model gets the weights
    they stand for and rounds each expert's inputs per group of `block`."""

    def write(prefix: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q, scale, stood_for = _block_fp8(weight.float(), block)
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale_inv": scale}, stood_for

    quantized_writers.write_experts_apart(model, folder, write)
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            forward = functools.partial(fp8_experts_forward, group=block)
            experts.forward = types.MethodType(forward, experts)


def _block_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] in e4m3 with a scale per [block, block] block, and w as they stand for it."""
    n, k = w.shape
    blocks = w.reshape(n // block, block, k // block, block)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [N / block, K / block]
    expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    q = (w / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale, q.float() * expanded


@pytest.mark.slow
def test_block_scaled_fp8_expert_checkpoints_match_transformers_on_their_weights(
    tmp_path: Path,
) -> None:
    """Experts as FP8 checkpoints of MoE models publish them (Qwen3-30B-A3B-FP8: e4m3 with a
    scale per 128 x 128 block, here 32 x 32), beside block-scaled dense projections."""
    model = tiny_moe("qwen3_moe")
    prompts = make_prompts(model.config.vocab_size)
    quantized_writers.write_fp8_block(model, tmp_path, (32, 32), compressed=False)
    write_fp8_experts(model, tmp_path, 32)
    fake_quantize_inputs_fp8(model, group=32)
    expected = [hf_greedy_top(model, prompt) for prompt in prompts]
    # One sequence at a time, as transformers runs them: a batch's float32 sums in another
    # order move a value rounded to e4m3 by a whole step now and then, and a router that
    # then picks another expert moves the logits past a near tie. The CPU's own kernels
    # order sums otherwise too (an AMD EPYC's flipped one sequence's routing at token 24):
    # one such flip is allowed, past the first tokens.
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_num_seqs=1)  # fp8 from config
    check_close(expected, llm, prompts, routing_flips=1)
    experts = llm.runner.model.layers[0].mlp
    assert experts.experts_gate_up_scale.shape == (8, 64, 2)  # a scale per row and 32 columns
