"""`LLM.embed` equals transformers' pooled last hidden states, for last-token and mean pooling,
whether a prompt runs in one step or is chunked across several, and holds no KV afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow import LLM
from shared.protocol import ParameterError
from tests.integration.tiny_embedding import (
    make_tiny_embedding_model,
    reference_embeddings,
    save_tiny_embedding_model,
)
from tests.integration.tiny_models import TINY_ENGINE, make_prompts

# Chunks of 16 split every prompt past 16 tokens across steps: pooling must span them.
# A pool of 6 blocks of 16 holds one or two prompts at once: the others wait, or are preempted
# in the middle of their prompt and pooled again from its start.
SETTINGS = {
    "whole prompts": {},
    "chunked prefill 16": dict(max_num_batched_tokens=16),
    "small pool": dict(max_num_batched_tokens=32, num_gpu_blocks_override=6, block_size=16),
}


@pytest.fixture(scope="module", params=["last", "mean"])
def pooled_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    pooling = request.param
    folder = save_tiny_embedding_model(tmp_path_factory.mktemp(f"embed-{pooling}"), pooling)
    prompts = make_prompts(384)
    expected = reference_embeddings(make_tiny_embedding_model(), prompts, pooling, True)
    return pooling, Path(folder), prompts, expected


def cosines(got: list[list[float]], expected: list[torch.Tensor]) -> list[float]:
    return [
        torch.nn.functional.cosine_similarity(torch.tensor(g), e, dim=0).item()
        for g, e in zip(got, expected, strict=True)
    ]


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_embeddings_match_transformers(pooled_model, setting: str) -> None:
    pooling, folder, prompts, expected = pooled_model
    llm = LLM(str(folder), **TINY_ENGINE, **SETTINGS[setting])
    assert llm.task == "embed"  # found from the sentence-transformers files
    results = llm.embed(prompts)
    assert [r.prompt_token_ids for r in results] == prompts
    assert min(cosines([r.embedding for r in results], expected)) >= 1 - 1e-3, (pooling, setting)
    for result in results:
        assert abs(sum(x * x for x in result.embedding) - 1.0) < 1e-4  # normalized
    # The same prompts again: no prefix cache is read, and nothing stays referenced.
    again = llm.embed(prompts)
    assert min(cosines([r.embedding for r in again], expected)) >= 1 - 1e-3
    stats = llm.stats()
    assert stats.kv_usage == 0.0 and stats.num_running == 0
    assert stats.prefix_cache_hits == 0
    assert stats.num_generation_tokens == 0  # the token computed with each embedding is dropped
    if setting == "small pool":
        assert stats.num_preemptions > 0


def test_embed_and_generate_refuse_the_other_task(pooled_model, tiny_llama_dir: Path) -> None:
    _, folder, prompts, _ = pooled_model
    embedder = LLM(str(folder), **TINY_ENGINE)
    with pytest.raises(ParameterError, match="loaded for embed"):
        embedder.generate(prompts[:1])
    generator = LLM(str(tiny_llama_dir), **TINY_ENGINE)
    assert generator.task == "generate"
    with pytest.raises(ParameterError, match="loaded for generate"):
        generator.embed([[1, 2, 3]])


def test_dimensions_need_a_matryoshka_model(tmp_path: Path) -> None:
    plain = LLM(str(save_tiny_embedding_model(tmp_path / "plain")), **TINY_ENGINE)
    with pytest.raises(ParameterError, match="shorter embeddings") as caught:
        plain.embed([[5, 6, 7]], dimensions=16)
    assert caught.value.param == "dimensions"
    folder = save_tiny_embedding_model(tmp_path / "matryoshka", matryoshka=True)
    llm = LLM(str(folder), **TINY_ENGINE)
    [full] = llm.embed([[5, 6, 7]])
    [short] = llm.embed([[5, 6, 7]], dimensions=16)
    head = torch.nn.functional.normalize(torch.tensor(full.embedding[:16]), dim=0)
    assert torch.allclose(torch.tensor(short.embedding), head, atol=1e-6)


def test_a_prompt_may_fill_the_context(tmp_path: Path) -> None:
    """No token follows an embedding's prompt, so it may take all of max_model_len."""
    folder = save_tiny_embedding_model(tmp_path / "m")
    llm = LLM(str(folder), **TINY_ENGINE, max_model_len=64)
    prompt = list(range(10, 74))
    [result] = llm.embed(prompt)
    [expected] = reference_embeddings(make_tiny_embedding_model(), [prompt], "last", True)
    assert min(cosines([result.embedding], [expected])) >= 1 - 1e-3
    with pytest.raises(ParameterError, match="prompt"):
        llm.embed([*prompt, 5])


def test_task_embed_forces_a_causal_lm_to_embed(tiny_llama_dir: Path) -> None:
    """--task embed on a ...ForCausalLM folder: vLLM's defaults, last token and normalized."""
    llm = LLM(str(tiny_llama_dir), **TINY_ENGINE, task="embed")
    [result] = llm.embed([[5, 6, 7, 8]])
    assert len(result.embedding) == 64
    assert abs(sum(x * x for x in result.embedding) - 1.0) < 1e-4
