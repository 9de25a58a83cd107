"""Structured output under a reasoning parser constrains the answer alone: the tokenizer worker
names the reasoning's end token, and the executor leaves the row free until it has come."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from services.executor.runner.grammar import GrammarMatchers, grammar_input
from services.executor.runner.step_state import RequestState
from services.tokenizer.worker import TokenizerWorker
from shared.protocol import (
    ChatMessage,
    GenerateRequest,
    NewRequestData,
    SamplingParams,
    StructuredOutput,
)
from tests.unit.test_reasoning_worker import THINKING_TEMPLATE

CPU = torch.device("cpu")
SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}})
END = 7  # stands for `</think>`'s id


def spec(end_ids: list[int]) -> StructuredOutput:
    return StructuredOutput(json=SCHEMA, reasoning_end_token_ids=end_ids)


def test_the_grammar_reads_the_tokens_after_the_reasoning() -> None:
    assert grammar_input(spec([]), [1, 2]) == [1, 2]  # no reasoning parser: all of them
    assert grammar_input(spec([END]), [1, 2]) is None  # still thinking
    assert grammar_input(spec([END]), [1, END, 3, END]) == [3, END]
    assert grammar_input(spec([END]), [END]) == []


@pytest.fixture(scope="module")
def matchers(smollm2_tokenizer) -> GrammarMatchers:
    return GrammarMatchers(
        lambda: smollm2_tokenizer, len(smollm2_tokenizer), [smollm2_tokenizer.eos_token_id]
    )


def state(matchers: GrammarMatchers, output_ids: list[int]) -> RequestState:
    params = SamplingParams(structured_output=spec([END]))
    data = NewRequestData(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        output_token_ids=output_ids,
        sampling_params=params,
        block_ids=[0],
        num_computed_tokens=0,
    )
    assert params.structured_output is not None
    return RequestState.from_new(data, matchers.matcher(params.structured_output, output_ids))


def test_the_row_is_free_until_the_reasoning_ends(matchers: GrammarMatchers) -> None:
    fresh = matchers.matcher(spec([]), [])
    thinking = matchers.tokenizer.tokenize_str("Hmm, x then")
    row = state(matchers, [])
    assert row.grammar_waits
    for token_id in [*thinking, END]:
        row.num_pending += 1
        row.take([token_id])  # none of these would fit the grammar: it did not read them
    assert not row.grammar_waits and row.matcher is not None and not row.matcher.is_error()
    assert torch.equal(*matchers.bitmask([fresh, row.matcher], CPU))
    for token_id in matchers.tokenizer.tokenize_str('{"ok": true}'):
        row.num_pending += 1
        row.take([token_id])
    assert row.matcher.is_accepting()


def test_a_resumed_request_replays_the_answer_only(matchers: GrammarMatchers) -> None:
    answer = matchers.tokenizer.tokenize_str('{"ok": fa')
    by_hand = matchers.matcher(spec([]), answer)
    resumed = state(matchers, [*matchers.tokenizer.tokenize_str("Hmm"), END, *answer])
    assert not resumed.grammar_waits and resumed.matcher is not None
    assert torch.equal(*matchers.bitmask([by_hand, resumed.matcher], CPU))
    assert state(matchers, matchers.tokenizer.tokenize_str("still")).grammar_waits


@pytest.fixture(scope="module")
def think_tokenizer(smollm2_tokenizer):
    """SmolLM2's tokenizer with `<think>` and `</think>` as single tokens, as Qwen3's has."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def workers(think_tokenizer) -> dict[str, TokenizerWorker]:
    """One worker per parser for the module: each makes its grammar tokenizer once (1 s)."""
    return {p: TokenizerWorker(copy.copy(think_tokenizer), reasoning_parser=p) for p in PARSERS}


PARSERS = ("qwen3", "deepseek_r1")
JSON_OBJECT = SamplingParams(structured_output=StructuredOutput(json_object=True))


def admitted_spec(worker: TokenizerWorker, **fields: object) -> StructuredOutput | None:
    request = GenerateRequest(request_id="r", sampling_params=JSON_OBJECT, **fields)  # type: ignore[arg-type]
    spec = worker.admit(request).sampling_params.structured_output
    worker.abort(["r"])
    return spec


def test_the_worker_starts_the_grammar_after_think_end(workers, think_tokenizer) -> None:
    end_id = think_tokenizer.convert_tokens_to_ids("</think>")
    chat = {"messages": [ChatMessage("user", "Answer in JSON")]}
    for parser in PARSERS:
        got = admitted_spec(workers[parser], **chat)
        assert got is not None and got.reasoning_end_token_ids == [end_id]
    # Qwen3 with thinking off: the prompt closed the thinking, the answer starts at once
    off = admitted_spec(workers["qwen3"], **chat, chat_template_kwargs={"enable_thinking": False})
    assert off is not None and off.reasoning_end_token_ids == []
    # A completion is not read for thinking: its grammar covers all of it
    plain = admitted_spec(workers["deepseek_r1"], prompt="x")
    assert plain == StructuredOutput(json_object=True)


def test_without_a_single_end_token_the_grammar_covers_everything(smollm2_tokenizer) -> None:
    worker = TokenizerWorker(copy.copy(smollm2_tokenizer), reasoning_parser="deepseek_r1")
    assert worker.tokenizer is not None
    worker.tokenizer.chat_template = THINKING_TEMPLATE
    got = admitted_spec(worker, messages=[ChatMessage("user", "JSON")])  # `</think>`: 3 tokens
    assert got is not None and got.reasoning_end_token_ids == []
