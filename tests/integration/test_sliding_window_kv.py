"""Sliding-window layers give the blocks behind the window back to the pool as a request
advances (shared/kv_groups.py): where every layer slides, a request many times longer than the
KV cache runs, with transformers' greedy tokens, where keeping every block
(--disable-hybrid-kv-cache-manager) refuses it; speculative decoding's rejected drafts fall back
within the blocks it keeps; a model mixing sliding and full layers holds a long request in
less memory than one table for all layers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.llm import LLM
from tests.integration.test_host_kv_tier import chat
from tests.integration.test_parity import hf_greedy, kvflow_greedy
from tests.integration.test_pipelined_engine import ON_CUDA
from tests.integration.test_speculative import KnownDrafts
from tests.integration.tiny_models import make_prompts, make_tiny_model

NEW_TOKENS = 96


@pytest.mark.parametrize("family", ["mistral sliding", "phi3"])
def test_a_request_longer_than_the_cache_runs_in_its_window(family: str, tmp_path: Path) -> None:
    model = make_tiny_model(family)
    model.save_pretrained(tmp_path)
    prompts = [make_prompts(model.config.vocab_size)[-1]]  # 70 tokens: 166 with its outputs
    expected = hf_greedy(model, prompts, NEW_TOKENS, eos_token_id=None)
    # 6 blocks of 16 tokens (96; one is the null block), steps of 16 tokens: a window of 12
    # or 20 needs 3 or 4 blocks at a time.
    small = dict(
        device="cpu", dtype="float32", num_gpu_blocks_override=6, max_num_batched_tokens=16
    )
    llm = LLM(str(tmp_path), **small)
    assert kvflow_greedy(llm, prompts, ignore_eos=True, num_new_tokens=NEW_TOKENS) == expected
    assert llm.stats().num_preemptions == 0
    keeping = LLM(str(tmp_path), disable_hybrid_kv_cache_manager=True, **small)
    with pytest.raises(ValueError, match="more KV blocks than the whole cache holds"):
        kvflow_greedy(keeping, prompts, ignore_eos=True, num_new_tokens=NEW_TOKENS)


def test_rejected_drafts_fall_back_inside_what_the_window_kept(tmp_path: Path) -> None:
    """Verifying rows whose drafts are rejected (the plain run's tokens as drafts, one in three
    spoiled) compute again from an earlier position: its window's blocks are still held, so
    the tokens are the plain run's, in a cache smaller than the requests."""
    model = make_tiny_model("mistral sliding")
    model.save_pretrained(tmp_path)
    prompts = make_prompts(model.config.vocab_size)[-3:]
    expected = hf_greedy(model, prompts, NEW_TOKENS, eos_token_id=None)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2}
    small = dict(device="cpu", dtype="float32", num_gpu_blocks_override=12)
    llm = LLM(str(tmp_path), speculative_config=spec, max_num_batched_tokens=32, **small)
    llm.runner.proposer = KnownDrafts(expected, 4, prompts)  # type: ignore[assignment]
    assert kvflow_greedy(llm, prompts, ignore_eos=True, num_new_tokens=NEW_TOKENS) == expected
    stats = llm.engine.scheduler.spec_decode
    assert 1.5 < stats.mean_acceptance_length < 4.5  # drafts both accepted and rejected
    llm.engine.scheduler.check_invariants()


def test_a_model_mixing_sliding_and_full_layers_holds_a_long_request_in_less(
    tmp_path: Path,
) -> None:
    """Gemma 2's sliding and full layers in groups of their own, a block holding one layer of
    each: the sliding group gives back what left its window, the full one keeps every block.
    A 166-token request needs 11 blocks of the full group, 3 of the sliding one and the null
    block: 15 blocks of one layer, within 64 KiB of cache (16), where one table for both
    layers would need 11 blocks of two (88 KiB) and refuses it."""
    model = make_tiny_model("gemma2")
    model.save_pretrained(tmp_path)
    prompts = [make_prompts(model.config.vocab_size)[-1]]
    expected = hf_greedy(model, prompts, NEW_TOKENS, eos_token_id=None)
    small = dict(
        device="cpu", dtype="float32", kv_cache_memory_bytes=64 * 1024, max_num_batched_tokens=16
    )
    llm = LLM(str(tmp_path), **small)
    assert kvflow_greedy(llm, prompts, ignore_eos=True, num_new_tokens=NEW_TOKENS) == expected
    assert llm.engine.scheduler.kv.num_groups == 2
    keeping = LLM(str(tmp_path), disable_hybrid_kv_cache_manager=True, **small)
    with pytest.raises(ValueError, match="more KV blocks than the whole cache holds"):
        kvflow_greedy(keeping, prompts, ignore_eos=True, num_new_tokens=NEW_TOKENS)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("together", [False, True])
def test_layer_groups_restore_their_blocks_from_the_host_tier(
    tmp_path: Path, together: bool, device: str
) -> None:
    """Gemma 2's two groups with a host tier: a conversation's evicted prefix comes back, each
    group's blocks under its own key (the sliding group's within its window only), with the
    tokens of an engine without the tier. On a GPU, under CUDA graphs: the restored blocks
    reach the tables the captured steps read."""
    model = make_tiny_model("gemma2")
    model.save_pretrained(tmp_path)
    settings = dict(
        device=device, dtype="float32", num_gpu_blocks_override=14, block_size=16,
        max_model_len=256,
    )  # fmt: skip
    expected = chat(LLM(str(tmp_path), **settings), together)
    llm = LLM(str(tmp_path), kv_offloading_size=2**20 / 2**30, **settings)
    assert chat(llm, together) == expected
    assert llm.engine.scheduler.kv.num_groups == 2
    tier = llm.stats().host_tier
    assert tier is not None and tier.blocks_to_gpu > 0 and tier.hits > 0
    llm.engine.scheduler.check_invariants()
