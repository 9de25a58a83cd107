"""`--kv-cache-dtype fp8`: the same memory holds twice the KV blocks (four times in float32),
and the greedy tokens are those of transformers running the same model with its keys and
values rounded to e4m3 (an attention function registered with transformers that rounds them
before its SDPA). As for FP8 weights, last-bit differences may flip a near tie, so a sequence
may leave at one, where each side's token must be among the other's top choices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvflow import LLM
from tests.integration.test_gpu_parity import hf_greedy_top
from tests.integration.test_quantized_parity import check_close
from tests.integration.tiny_models import make_prompts, make_tiny_model


def fp8_kv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: object,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' SDPA attention on keys and values as an e4m3 cache holds them."""

    def e4m3(x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)

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
