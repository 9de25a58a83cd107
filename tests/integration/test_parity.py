"""Greedy generation is token-for-token identical to transformers, for every model family.

transformers generates each prompt alone (no padding); kvflow generates all of them in one
continuous batch, under several engine settings that must not change a single token:
prefix caching, small prefill chunks, and a KV pool so small that requests get preempted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
import transformers

from kernels import ops
from kvflow import LLM, SamplingParams
from shared.kv_groups import kv_groups
from shared.model_config import embedded_model_path, load_model_config, resolve_model_source
from tests.integration.tiny_models import (
    FAMILIES,
    MOE_FAMILIES,
    NUM_NEW_TOKENS,
    TINY,
    TINY_ENGINE,
    make_prompts,
)

PARITY_FAMILIES = {**FAMILIES, **MOE_FAMILIES}  # the mixtures of experts' too

# Settings that must not change the output. "small pool" forces preemptions.
VARIANTS = {
    "no prefix cache": dict(enable_prefix_caching=False),
    "chunked prefill 32": dict(max_num_batched_tokens=32),
    "small pool": dict(num_gpu_blocks_override=14, block_size=16),
}


def hf_greedy(
    model: torch.nn.Module,
    prompts: list[list[int]],
    num_new_tokens: int = NUM_NEW_TOKENS,
    **kwargs: object,
) -> list[list[int]]:
    outputs = []
    for ids in prompts:
        tokens = model.generate(
            torch.tensor([ids]), max_new_tokens=num_new_tokens, do_sample=False, **kwargs
        )
        outputs.append(tokens[0, len(ids) :].tolist())
    return outputs


def kvflow_greedy(
    llm: LLM, prompts: list[list[int]], ignore_eos: bool, num_new_tokens: int = NUM_NEW_TOKENS
) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=num_new_tokens, ignore_eos=ignore_eos)
    return [r.token_ids for r in llm.generate(prompts, params)]


@pytest.fixture(scope="module", params=sorted(PARITY_FAMILIES))
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family = request.param
    config_cls, extra = PARITY_FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases, or the qkv-bias path would test nothing
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.2)
    folder = tmp_path_factory.mktemp(family.replace(" ", "_"))
    model.save_pretrained(folder)
    prompts = make_prompts(config.vocab_size)
    return family, Path(folder), prompts, hf_greedy(model, prompts, eos_token_id=None)


def test_tiny_model_matches_transformers(tiny_model) -> None:
    family, folder, prompts, expected = tiny_model
    llm = LLM(str(folder), **TINY_ENGINE)
    assert kvflow_greedy(llm, prompts, ignore_eos=True) == expected, family
    # A second pass over the same prompts is served from the prefix cache.
    assert kvflow_greedy(llm, prompts, ignore_eos=True) == expected, family
    assert llm.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("tiny_model", ["gemma2", "gemma3_text", "olmo2"], indirect=True)
def test_layers_read_nothing_the_fused_norm_overwrote(tiny_model, monkeypatch) -> None:
    """On a GPU the fused norms write both results in place of their inputs (the CPU's ops
    return new tensors): the layers that norm after each sublayer read nothing they overwrote."""
    for name in ("fused_add_rms_norm", "fused_norm_add_rms_norm"):
        monkeypatch.setattr(ops, name, _in_place(getattr(ops, name)))
    family, folder, prompts, expected = tiny_model
    llm = LLM(str(folder), **TINY_ENGINE)
    assert kvflow_greedy(llm, prompts, ignore_eos=True) == expected, family


def _in_place(reference: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., Any]:
    """`reference` (x, residual, ...) -> (normed, sum), writing both into its first two inputs."""

    def in_place(
        x: torch.Tensor, residual: torch.Tensor, *weights: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, summed = reference(x, residual, *weights)
        x.copy_(normed)
        residual.copy_(summed)
        return x, residual

    return in_place


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_model_output_survives_engine_settings(tiny_model, variant: str) -> None:
    family, folder, prompts, expected = tiny_model
    settings = dict(VARIANTS[variant])
    if "num_gpu_blocks_override" in settings:  # the same memory: a block holds a group's layers
        groups = kv_groups(load_model_config(resolve_model_source(str(folder))))
        settings["num_gpu_blocks_override"] *= groups.num_groups
    llm = LLM(str(folder), **TINY_ENGINE, **settings)
    assert kvflow_greedy(llm, prompts, ignore_eos=True) == expected, (family, variant)
    if variant == "small pool":
        assert llm.stats().num_preemptions > 0


# Tokens generated per prompt on the embedded model: transformers' reference runs them one
# prompt at a time (it was two minutes of the suite at 64 tokens; five prompts, not eight, since
# 2026-12-03).
SMOLLM2_NEW_TOKENS = 20


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_tokenizer):
    path = embedded_model_path()
    tokenizer = smollm2_tokenizer  # the prompts' ids: both engines get the same ones
    # transformers parses the file twice (its config, its weights) and builds gguf's tensor
    # name map once a tensor: both cached while it loads (the same model; some 15 s less).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village at the edge of a dark forest, there lived",
        "Q: What is 12 times 12?\nA:",
        "The theory of relativity, proposed by Albert Einstein in the early twentieth "
        "century, changed how physicists think about space, time and gravity. In simple terms,",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    return prompts, hf_greedy(model, prompts, SMOLLM2_NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"max_num_batched_tokens": 32, "num_gpu_blocks_override": 12},
    ],
    ids=["default", "chunked+preempting"],
)
def test_embedded_smollm2_matches_transformers(smollm2_reference, settings: dict) -> None:
    prompts, expected = smollm2_reference
    llm = LLM(dtype="float32", device="cpu", **settings)
    assert kvflow_greedy(llm, prompts, ignore_eos=False, num_new_tokens=SMOLLM2_NEW_TOKENS) == (
        expected
    )
    if settings:
        assert llm.stats().num_preemptions > 0


def test_gemma2s_soft_capped_logprobs_are_transformers(tmp_path: Path) -> None:
    """Gemma 2's caps change the distribution, not only the order: a prompt's logprobs (past
    the window, with capped scores and capped logits) equal transformers'."""
    config_cls, extra = FAMILIES["gemma2"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**{**TINY, **extra}), dtype=torch.float32
    ).eval()
    model.save_pretrained(tmp_path)
    prompt = make_prompts(TINY["vocab_size"])[6]  # 57 tokens: several windows of 12
    wanted = _prompt_logprobs(model, prompt)
    # Each cap bites: without either one, transformers' own logprobs move.
    for cap in (None, extra["attn_logit_softcapping"]):
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = cap
        model.config.final_logit_softcapping = None if cap else extra["final_logit_softcapping"]
        moved = zip(_prompt_logprobs(model, prompt), wanted, strict=True)
        assert max(abs(a - b) for a, b in moved) > 1e-2
    llm = LLM(str(tmp_path), **TINY_ENGINE)
    result = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert result.prompt_logprobs is not None
    got = [entry.logprob for entry in result.prompt_logprobs[1:]]
    assert got == pytest.approx(wanted, abs=1e-4)


def test_soft_capped_logits_of_a_bf16_model_keep_their_order(tmp_path: Path) -> None:
    """Near the cap tanh flattens logits: rounded back to bf16 the top ones tie (a GPU run
    sampled the lowest id of the ties, not transformers' argmax). They stay float32, in the
    order of the uncapped bf16 logits."""
    config_cls, extra = FAMILIES["gemma2"]
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **extra})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = LLM(str(tmp_path), **{**TINY_ENGINE, "dtype": "bfloat16"}).runner.model
    hidden = torch.randn(4, TINY["hidden_size"], dtype=torch.bfloat16) * 2  # logits near 3x cap
    logits = model.compute_logits(hidden)
    raw = model.lm_head(hidden).float()
    assert logits.dtype == torch.float32
    assert torch.equal(logits.argmax(dim=-1), raw.argmax(dim=-1))
    assert torch.equal(logits.topk(5).indices, raw.topk(5).indices)


def _prompt_logprobs(model: transformers.PreTrainedModel, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt])).logits[0].log_softmax(dim=-1)
    return [logprobs[i, token].item() for i, token in enumerate(prompt[1:])]


def test_gemma3s_text_model_loads_from_a_model_for_text_and_images(tmp_path: Path) -> None:
    """A Gemma 3 checkpoint for text and images (`Gemma3ForConditionalGeneration`, as the 4B,
    12B and 27B models are published): its text model's tensors and config are read, the image
    model's left; greedy tokens equal its own on text."""
    config_cls, extra = FAMILIES["gemma3_text"]
    text = config_cls(**{**TINY, **extra}).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = transformers.Gemma3Config(
        text_config=text, vision_config={**vision, "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms of 1 + w away from 1
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(std=0.2)
    model.save_pretrained(tmp_path)
    prompts = make_prompts(TINY["vocab_size"])[:3]
    expected = hf_greedy(model, prompts, NUM_NEW_TOKENS, eos_token_id=None)
    llm = LLM(str(tmp_path), **TINY_ENGINE, max_model_len=256)
    assert kvflow_greedy(llm, prompts, ignore_eos=True) == expected
