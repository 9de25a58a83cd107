"""Quantized linear layers (`--quantization`) give the greedy tokens of transformers running
the same model with the reference's quantization applied to it: weights quantized and
dequantized per output channel, and every linear layer's input per token (FP8 W8A8).

The reference side is built independently of kvflow's executor: forward pre-hooks on each of
the Hugging Face model's nn.Linear layers (the lm_head excepted, as kvflow keeps it float).

Why "greedy or a near tie" and not token-exact: quantizing activations rounds to a grid, so
the last-bit differences between kvflow's kernels and transformers' (a norm summed in another
order) can move a value across a rounding boundary and flip a near tie. So, as vLLM's tests
judge quantized models, each sequence must match until its first divergence, and there each
side's token must be among the other's top choices; most sequences must match throughout.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kernels.fp8 import (
    dequantize_fp8_groupwise,
    quantize_fp8_groupwise_reference,
    quantize_fp8_rowwise_reference,
)
from kvflow import LLM, SamplingParams
from services.executor import layers
from tests import quantized_writers
from tests.integration.test_gpu_parity import TOP, Top, hf_greedy_top
from tests.integration.test_parity import hf_greedy
from tests.integration.tiny_models import (
    NUM_NEW_TOKENS,
    TINY_ENGINE,
    make_prompts,
    make_tiny_model,
)


def fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """x quantized to e4m3 per row (of its last dimension) and back."""
    q, scale = quantize_fp8_rowwise_reference(x.reshape(-1, x.shape[-1]))
    return (q.float() * scale).reshape(x.shape).to(x.dtype)


def fake_fp8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x quantized to e4m3 per row and group of `group` columns, and back."""
    q, scale = quantize_fp8_groupwise_reference(x.reshape(-1, x.shape[-1]), group)
    return dequantize_fp8_groupwise(q, scale).reshape(x.shape).to(x.dtype)


def fake_quantize_inputs_fp8(model: torch.nn.Module, group: int | None = None) -> None:
    """Every linear layer but the lm_head sees its input quantized per token (and per group
    of columns, for block-scaled weights)."""

    def hook(_module: torch.nn.Module, args: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        return (fake_fp8(args[0]) if group is None else fake_fp8_groups(args[0], group),)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            module.register_forward_pre_hook(hook)


def static_fp8_input(scale: torch.Tensor) -> Callable[..., tuple[torch.Tensor]]:
    """A forward pre-hook: the layer's input quantized to e4m3 by a static scale, and back."""

    def hook(_module: torch.nn.Module, args: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        q = (args[0].float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return ((q.float() * scale).to(args[0].dtype),)

    return hook


def fake_quantize_fp8(model: torch.nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            module.weight.data = fake_fp8(module.weight.data)
    fake_quantize_inputs_fp8(model)


FLIP_AFTER = 16  # tokens that must agree before a mixture's routing may flip (check_close)


def check_close(
    expected: list[tuple[list[int], list[Top]]],
    llm: LLM,
    prompts: list[list[int]],
    routing_flips: int = 0,
) -> None:
    """Greedy tokens as transformers': every sequence but two alike throughout, and where
    one parts, each engine's token among the other's top 5 there. `routing_flips`: of those
    two, how many may part past their first FLIP_AFTER tokens with no such closeness (a
    mixture whose router picked another expert: its logits move by more than a tie)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=TOP
    )
    results = llm.generate(prompts, params)
    num_exact = 0
    for (want, want_tops), result in zip(expected, results, strict=True):
        got = result.token_ids
        diverged = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if diverged is None:
            num_exact += 1
            continue
        got_top = [t.token_id for t in result.outputs[0].logprobs[diverged].top]
        close = got[diverged] in want_tops[diverged] and want[diverged] in got_top
        if not close and routing_flips and diverged >= FLIP_AFTER:
            routing_flips -= 1
            continue
        assert close, (diverged, got, want)
    assert num_exact >= len(prompts) - 2, f"only {num_exact} of {len(prompts)} match throughout"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp8_matches_transformers_with_the_reference_quantization(
    family: str, tmp_path: object
) -> None:
    model = make_tiny_model(family)
    model.save_pretrained(tmp_path)
    prompts = make_prompts(model.config.vocab_size)
    plain = hf_greedy(model, prompts, eos_token_id=None)
    fake_quantize_fp8(model)
    expected = [hf_greedy_top(model, prompt) for prompt in prompts]
    assert [tokens for tokens, _ in expected] != plain  # the quantization changes the output
    llm = LLM(str(tmp_path), **TINY_ENGINE, quantization="fp8")
    check_close(expected, llm, prompts)
    # Chunks and a KV pool small enough to preempt change nothing either.
    small = LLM(
        str(tmp_path),
        **TINY_ENGINE,
        quantization="fp8",
        max_num_batched_tokens=32,
        num_gpu_blocks_override=14,
    )
    check_close(expected, small, prompts)
    assert small.stats().num_preemptions > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("per_tensor", [False, True], ids=["ct-channel", "fp8-tensor"])
def test_fp8_checkpoints_match_transformers_on_their_weights(
    family: str, per_tensor: bool, tmp_path: Path
) -> None:
    """FP8 checkpoints (compressed-tensors FP8_DYNAMIC with a scale per channel, transformers'
    `quant_method: fp8` with one per tensor) against transformers on the weights they hold,
    with activations quantized per token as the checkpoints' configs say."""
    model = make_tiny_model(family)
    prompts = make_prompts(model.config.vocab_size)
    quantized_writers.write_fp8(model, tmp_path, per_tensor)  # the model holds them now
    fake_quantize_inputs_fp8(model)
    expected = [hf_greedy_top(model, prompt) for prompt in prompts]
    llm = LLM(str(tmp_path), **TINY_ENGINE)  # fp8 from config.json
    check_close(expected, llm, prompts)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("compressed", [False, True], ids=["fp8-static", "ct-static"])
def test_static_fp8_checkpoints_match_transformers_on_their_weights(
    family: str, compressed: bool, tmp_path: Path
) -> None:
    """FP8 checkpoints with static activation scales (AutoFP8's `activation_scheme: static`,
    compressed-tensors' FP8 scheme) against transformers on their weights, each layer's input
    quantized by its calibrated scale."""
    model = make_tiny_model(family)
    prompts = make_prompts(model.config.vocab_size)
    input_scales = quantized_writers.write_fp8_static(model, tmp_path, prompts, compressed)
    modules = dict(model.named_modules())
    for name, scale in input_scales.items():
        modules[name].register_forward_pre_hook(static_fp8_input(scale))
    expected = [hf_greedy_top(model, prompt) for prompt in prompts]
    llm = LLM(str(tmp_path), **TINY_ENGINE)  # static FP8 from config.json
    check_close(expected, llm, prompts)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("compressed", [False, True], ids=["fp8-block", "ct-block"])
def test_block_scaled_fp8_checkpoints_match_transformers_on_their_weights(
    family: str, compressed: bool, tmp_path: Path
) -> None:
    """Block-scaled FP8 (transformers' `weight_block_size` with `weight_scale_inv`,
    compressed-tensors' FP8_BLOCK) against transformers on the weights they hold, with
    activations quantized per token and group of the block's columns."""
    model = make_tiny_model(family)
    prompts = make_prompts(model.config.vocab_size)
    quantized_writers.write_fp8_block(model, tmp_path, (32, 32), compressed)
    fake_quantize_inputs_fp8(model, group=32)
    expected = [hf_greedy_top(model, prompt) for prompt in prompts]
    llm = LLM(str(tmp_path), **TINY_ENGINE)  # the method from config.json
    check_close(expected, llm, prompts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_gpu_fp8_inputs_quantized_by_their_producers_change_nothing(
    family: str, static: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton norms and SiLU-and-mul that quantize for the FP8 layers they feed (per token,
    or by a static checkpoint's scales) give the tokens and log-probabilities of the unfused
    kernels exactly (bf16, decode and prompts)."""
    model = make_tiny_model(family)
    prompts = make_prompts(model.config.vocab_size)
    if static:  # an AutoFP8-style checkpoint: quantization from its config.json
        quantized_writers.write_fp8_static(model, tmp_path, prompts, compressed=False)
    else:
        model.save_pretrained(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=3)

    def generate() -> list[tuple[list[int], list[list[float]]]]:
        llm = LLM(
            str(tmp_path),
            device="cuda",
            dtype="bfloat16",
            quantization=None if static else "fp8",
            max_model_len=512,
            kv_cache_memory_bytes=64 << 20,
        )
        results = llm.generate(prompts, params)
        return [
            (r.token_ids, [[t.logprob for t in step.top] for step in r.outputs[0].logprobs])
            for r in results
        ]

    fused = generate()
    # every layer quantizes its own input again
    monkeypatch.setattr(layers, "feeds_fp8_rows", lambda layer: False)
    assert generate() == fused
