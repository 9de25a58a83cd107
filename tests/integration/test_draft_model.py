"""Speculative decoding with a draft model (`method: draft_model`): a smaller model of the same
vocabulary drafts, with a KV cache of its own on the target's blocks, and the output is the one
the target gives without speculation, greedy or seeded, under the engine settings that move KV
around (chunked prompts, no prefix cache, a pool so small that requests are preempted).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kvflow import LLM, SamplingParams
from shared.protocol import EngineRequest
from tests.integration.test_eagle3 import PADDED_SETTINGS, pad_like_graphs, recording
from tests.integration.test_speculative import (
    GREEDY,
    MIXED,
    NGRAM,
    VARIANTS,
    generate,
    prompts,
)
from tests.integration.tiny_models import TINY, TINY_ENGINE, make_tiny_model


def tiny_draft(folder: Path, vocab_size: int = TINY["vocab_size"]) -> Path:
    """The target's first layer alone, with its embedding, norm and lm_head: a draft that
    agrees with it now and then (a model of its own random weights never would)."""
    target = make_tiny_model("llama")
    config = transformers.LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})
    config.vocab_size = vocab_size
    draft = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if vocab_size == target.config.vocab_size:
        draft.load_state_dict(target.state_dict(), strict=False)
    draft.save_pretrained(folder)
    return folder


def draft_config(folder: Path, num: int = 4) -> dict:
    return {"method": "draft_model", "model": str(folder), "num_speculative_tokens": num}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("target")
    make_tiny_model("llama").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_draft(tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="module")
def expected(target: Path) -> list[list[list[int]]]:
    """The target's own tokens without speculation: greedy, then the mixed sampling."""
    llm = LLM(str(target), **TINY_ENGINE)
    return [generate(llm, GREEDY), generate(llm, MIXED)]


def test_the_target_as_its_own_draft_has_its_drafts_accepted(
    target: Path, expected: list[list[list[int]]]
) -> None:
    llm = LLM(str(target), **TINY_ENGINE, speculative_config=draft_config(target))
    assert generate(llm, GREEDY) == expected[0]
    stats = llm.engine.scheduler.spec_decode
    # Greedy drafts from the same weights are the target's tokens (of 5 a step at most).
    assert stats.mean_acceptance_length > 4.5
    llm.engine.scheduler.check_invariants()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_draft_model_changes_no_output(
    target: Path, draft: Path, expected: list[list[list[int]]], variant: str
) -> None:
    settings = VARIANTS[variant]
    llm = LLM(
        str(target),
        **TINY_ENGINE,
        speculative_config=draft_config(draft),
        **settings,
    )
    assert generate(llm, GREEDY) == expected[0]
    assert generate(llm, MIXED) == expected[1]
    scheduler = llm.engine.scheduler
    assert 0 < scheduler.spec_decode.num_accepted_tokens < scheduler.spec_decode.num_draft_tokens
    scheduler.check_invariants()
    assert scheduler.kv.pool.num_available == scheduler.config.num_blocks  # nothing leaked
    if variant == "small pool":
        assert llm.stats().num_preemptions > 0


def test_a_draft_model_of_another_vocabulary_is_refused(target: Path, tmp_path: Path) -> None:
    other = tiny_draft(tmp_path, vocab_size=TINY["vocab_size"] * 2)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(target), **TINY_ENGINE, speculative_config=draft_config(other))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_request_aborted_with_a_step_in_flight_leaves_nothing_behind(
    target: Path, draft: Path, method: str
) -> None:
    """The step in flight is collected after the abort dropped the request: no drafts are
    taken for it, and no proposer state is left of it (a draft model keeps none per
    request: its KV follows the target's steps)."""
    spec = draft_config(draft) if method == "draft_model" else NGRAM
    llm = LLM(str(target), **TINY_ENGINE, speculative_config=spec)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts()[:2]):
        engine.add_request(
            EngineRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params)
        )
    while not engine.scheduler.requests["0"].num_pending_tokens:
        engine.step()
    engine.abort(["0"])
    while engine.has_unfinished():
        engine.step()
    engine.step()
    if method == "ngram":
        assert not llm.runner.proposer.indexes
    assert not llm.runner.requests
    engine.scheduler.check_invariants()


@pytest.mark.parametrize("setting", sorted(PADDED_SETTINGS))
def test_drafts_padded_to_a_graphs_shape_are_the_targets_tokens(target: Path, setting: str) -> None:
    """What a GPU's graphs do to the draft's work, on the CPU: each step (the target's, and
    the draft's catch-up and passes on its layout) padded to its graph's rows. The target
    drafting for itself: every draft is the token the target goes on to give, and rows whose
    room ends early (the short context, run to its end) draft fewer."""
    settings = PADDED_SETTINGS[setting]
    params = GREEDY
    if "max_model_len" in settings:
        params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    plain = generate(LLM(str(target), **TINY_ENGINE, **settings), params)
    llm = LLM(
        str(target), **TINY_ENGINE, speculative_config=draft_config(target),
        **settings,
    )  # fmt: skip
    target_graphs, proposer_graphs = pad_like_graphs(llm)
    records = recording(llm)
    assert generate(llm, params) == plain
    whole = [p + out for p, out in zip(prompts(), plain, strict=True)]
    wrong = 0
    for tokens, drafts in records:
        sequence = next(w for w in whole if w[: len(tokens)] == tokens)
        known = sequence[len(tokens) : len(tokens) + len(drafts)]  # the run's end: fewer
        wrong += drafts[: len(known)] != known
    assert len(records) > 20 and wrong <= len(records) // 20, (wrong, len(records))
    assert proposer_graphs.replays == target_graphs.replays > 0
    if "max_model_len" in settings:
        assert any(len(drafts) < 4 for _, drafts in records)
    scheduler = llm.engine.scheduler
    scheduler.check_invariants()
    assert scheduler.kv.pool.num_available == scheduler.config.num_blocks
