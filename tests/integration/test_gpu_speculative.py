"""On a GPU in bfloat16, under CUDA graphs and the pipelined loop: speculative decoding's greedy
tokens agree with the same engine's without it, by the closeness rule of test_gpu_parity (a
verifying row's logits come from the prefill attention, a plain decode's from the decode
attention: in bf16 they may round a near-tie apart, where each token must be in the other's top
5). Drafts are the plain run's own tokens, one set in three spoiled (tests/integration/
test_speculative.py), so rows accept 0..k of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams
from tests.integration.test_gpu_parity import SHAPE, TOP, build
from tests.integration.test_speculative import NGRAM, KnownDrafts, tokens_agreed_to_a_near_tie
from tests.integration.tiny_models import NUM_NEW_TOKENS, make_prompts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_speculative_greedy_agrees_with_plain(family: str, tmp_path: Path) -> None:
    build(family, tmp_path)
    settings = dict(device="cuda", dtype="bfloat16", max_model_len=512)
    settings["kv_cache_memory_bytes"] = 256 << 20
    prompts = make_prompts(SHAPE["vocab_size"])
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=TOP
    )
    plain = LLM(str(tmp_path), **settings).generate(prompts, params)
    llm = LLM(str(tmp_path), speculative_config=NGRAM, **settings)
    llm.runner.proposer = KnownDrafts(  # type: ignore[assignment]
        [r.token_ids for r in plain], NGRAM["num_speculative_tokens"], prompts
    )
    agreed = tokens_agreed_to_a_near_tie(llm.generate(prompts, params), plain)
    assert agreed >= len(prompts) * NUM_NEW_TOKENS // 2, f"only {agreed} tokens agreed"
    assert llm.engine.scheduler.spec_decode.mean_acceptance_length > 1.5


def invariant_plain_run(
    family: str, tmp_path: Path
) -> tuple[dict, list[list[int]], SamplingParams, list[list[int]]]:
    """A tiny model of `family` in tmp_path; the --batch-invariant settings of one request at a
    time, the prompts, greedy params, and the greedy tokens without speculation."""
    build(family, tmp_path)
    settings = dict(device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=1)
    settings.update(kv_cache_memory_bytes=256 << 20, batch_invariant=True)
    prompts = make_prompts(SHAPE["vocab_size"])
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    plain = [r.token_ids for r in LLM(str(tmp_path), **settings).generate(prompts, params)]
    return settings, prompts, params, plain


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batch_invariant_greedy_speculation_is_token_exact(family: str, tmp_path: Path) -> None:
    """--batch-invariant, one request at a time: a verifying row's tokens are computed as one-
    token decodes would be, so greedy output with drafts is the plain run's, token for token."""
    settings, prompts, params, plain = invariant_plain_run(family, tmp_path)
    llm = LLM(str(tmp_path), speculative_config=NGRAM, **settings)
    llm.runner.proposer = KnownDrafts(  # type: ignore[assignment]
        plain, NGRAM["num_speculative_tokens"], prompts
    )
    assert [r.token_ids for r in llm.generate(prompts, params)] == plain
    assert llm.engine.scheduler.spec_decode.mean_acceptance_length > 1.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_draft_model_under_graphs_drafts_the_targets_tokens(family: str, tmp_path: Path) -> None:
    """The model drafting for itself, its catch-up and passes replaying a CUDA graph for each
    of the target's step shapes: greedy output is the plain run's, token for token
    (--batch-invariant, one request at a time), and the drafts are the target's own tokens, so
    nearly all are accepted (inputs a graph failed to read would make them random)."""
    settings, prompts, params, plain = invariant_plain_run(family, tmp_path)
    spec = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 4}
    llm = LLM(str(tmp_path), speculative_config=spec, **settings)
    assert llm.runner.proposer.catch_up_graphs is not None  # type: ignore[union-attr]
    assert [r.token_ids for r in llm.generate(prompts, params)] == plain
    assert llm.engine.scheduler.spec_decode.mean_acceptance_length > 2.5
