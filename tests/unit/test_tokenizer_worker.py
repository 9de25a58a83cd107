"""The tokenizer worker's core: admission errors, stop strings, echo, logprob text, and a
model without a tokenizer."""

from __future__ import annotations

import copy
import json

import pytest

from services.tokenizer.worker import TokenizerWorker
from shared.protocol import (
    ChatMessage,
    ErrorKind,
    FinishReason,
    GenerateRequest,
    ParameterError,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
    TokenizeRequest,
    TokenLogprobs,
)


def make_worker(tokenizer) -> TokenizerWorker:
    return TokenizerWorker(copy.copy(tokenizer))


def request(**fields: object) -> GenerateRequest:
    fields.setdefault("sampling_params", SamplingParams())
    return GenerateRequest(request_id="r", **fields)  # type: ignore[arg-type]


def test_a_chat_template_error_is_the_clients_error(smollm2_tokenizer) -> None:
    worker = make_worker(smollm2_tokenizer)
    worker.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ParameterError, match="roles must alternate") as error:
        worker.admit(request(messages=[ChatMessage("user", "hi")]))
    assert error.value.param == "messages"
    result = worker.tokenize(TokenizeRequest(request_id="t", messages=[ChatMessage("user", "x")]))
    assert result.error is not None
    assert (result.error.kind, result.error.param) == (ErrorKind.INVALID_REQUEST, "messages")
    assert not worker.live


def test_out_of_vocabulary_prompt_ids_are_rejected(smollm2_tokenizer) -> None:
    with pytest.raises(ParameterError) as error:
        make_worker(smollm2_tokenizer).admit(request(prompt_token_ids=[1, 10**9]))
    assert error.value.param == "prompt"


def test_stop_string_ends_the_request_and_asks_the_scheduler_to_stop(smollm2_tokenizer) -> None:
    worker = make_worker(smollm2_tokenizer)
    admitted = worker.admit(
        request(
            sampling_params=SamplingParams(stop=["."]),
            prompt="The capital of France is",
            echo=True,
        )
    )
    assert admitted.prompt_token_ids == smollm2_tokenizer.encode("The capital of France is")
    ids = smollm2_tokenizer.encode(" Paris. It is big")
    lp = TokenLogprobs(ids[0], -0.1, 1, [ids[0]], [-0.1])
    deltas, stopped = worker.on_outputs(
        [
            RequestOutput(request_id="r", new_token_ids=ids[:1], new_logprobs=[lp]),
            RequestOutput(request_id="r", new_token_ids=ids[1:]),
        ]
    )
    assert deltas[0].prompt_text == "The capital of France is"  # echo, first delta only
    assert deltas[1].prompt_text is None
    [logprob] = deltas[0].logprobs
    assert (logprob.token_id, logprob.token, logprob.rank) == (ids[0], " Paris", 1)
    assert (logprob.top[0].token_id, logprob.top[0].token) == (ids[0], " Paris")
    assert "".join(d.text for d in deltas) == " Paris"
    assert [d.stop_reason for d in deltas] == [None, "."]  # the stop string that ended it
    assert deltas[-1].finish_reason is FinishReason.STOP and stopped == ["r"]
    assert not worker.live  # later outputs for "r" make no text (stopping it again is harmless)
    assert worker.on_outputs([RequestOutput(request_id="r", new_token_ids=ids)]) == ([], ["r"])


def test_outputs_of_a_request_this_worker_never_admitted_stop_it() -> None:
    """A worker restarted under the same name gets its previous process's requests: their
    clients are gone with it, so the engine is told to stop them."""
    worker = TokenizerWorker(None)
    running = RequestOutput(request_id="orphan", new_token_ids=[5])
    done = RequestOutput(request_id="done", new_token_ids=[6], finish_reason=FinishReason.LENGTH)
    assert worker.on_outputs([running, done]) == ([], ["orphan"])


def test_max_tokens_inside_a_character_leaves_no_replacement_character(smollm2_tokenizer) -> None:
    """The text of a request cut by its length limit in the middle of "🍕" ends before it."""
    worker = make_worker(smollm2_tokenizer)
    worker.admit(request(prompt="Food:"))
    ids = smollm2_tokenizer.encode(" pizza 🍕", add_special_tokens=False)
    cut = next(
        n for n in range(1, len(ids)) if smollm2_tokenizer.decode(ids[:n]).endswith("\ufffd")
    )
    outputs = [RequestOutput(request_id="r", new_token_ids=[i]) for i in ids[:cut]]
    outputs[-1].finish_reason = FinishReason.LENGTH
    deltas, _ = worker.on_outputs(outputs)
    text = "".join(d.text for d in deltas)
    assert text == " pizza " and "\ufffd" not in text
    assert deltas[-1].finish_reason is FinishReason.LENGTH


def test_the_priority_and_arrival_reach_the_engine_request() -> None:
    # The scheduler orders (or, under fcfs, refuses) by them: found by tests/e2e/test_http_fuzz.py.
    admitted = TokenizerWorker(None).admit(
        request(prompt_token_ids=[5], priority=-3, arrival_time=12.5)
    )
    assert (admitted.priority, admitted.arrival_time) == (-3, 12.5)


def test_a_model_without_a_tokenizer_takes_token_ids_only() -> None:
    worker = TokenizerWorker(None)
    admitted = worker.admit(request(prompt_token_ids=[5, 6, 7], echo=True))
    assert admitted.prompt_token_ids == [5, 6, 7]
    lp = TokenLogprobs(9, -0.5, 2, [8], [-0.1])
    output = RequestOutput(
        request_id="r", new_token_ids=[9], new_logprobs=[lp], finish_reason=FinishReason.LENGTH
    )
    [delta], _ = worker.on_outputs([output])
    assert (delta.text, delta.prompt_text, delta.token_ids) == ("", "", [9])
    assert (delta.logprobs[0].token_id, delta.logprobs[0].token) == (9, "")
    for fields, param in [
        ({"prompt": "hello"}, "prompt"),
        ({"messages": [ChatMessage("user", "hi")]}, "messages"),
        ({"prompt_token_ids": [1], "sampling_params": SamplingParams(stop=["x"])}, "stop"),
    ]:
        with pytest.raises(ParameterError) as error:
            worker.admit(request(**fields))
        assert error.value.param == param


def test_a_request_whose_text_fails_ends_alone_and_is_stopped(smollm2_tokenizer) -> None:
    worker = make_worker(smollm2_tokenizer)
    for request_id in ("bad", "good"):
        worker.admit(
            GenerateRequest(request_id=request_id, sampling_params=SamplingParams(), prompt="Hi")
        )
    deltas, ended = worker.on_outputs(
        [
            RequestOutput(request_id="bad", new_token_ids=[-1]),  # the tokenizer cannot decode it
            RequestOutput(request_id="good", new_token_ids=smollm2_tokenizer.encode(" there")),
        ]
    )
    failed, fine = deltas
    assert failed.error is not None and failed.error.kind is ErrorKind.INTERNAL
    assert ended == ["bad"] and list(worker.live) == ["good"]  # the engine stops "bad" too
    assert fine.text == " there" and fine.error is None


@pytest.mark.parametrize("lenient", [False, True])
def test_the_servers_json_rule_travels_with_the_structured_output(
    smollm2_tokenizer, lenient: bool
) -> None:
    """--no-disable-additional-properties reaches the engine in the request itself, since the
    executor builds each grammar from the message alone."""
    worker = TokenizerWorker(copy.copy(smollm2_tokenizer), lenient_json=lenient)
    spec = StructuredOutput(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    params = SamplingParams(structured_output=spec)
    admitted = worker.admit(request(prompt="Hi", sampling_params=params))
    structured = admitted.sampling_params.structured_output
    assert structured is not None and structured.lenient is lenient
    assert structured.json == spec.json


def test_tokenizer_info_is_the_tokenizer_config_as_json(smollm2_tokenizer) -> None:
    answer = make_worker(smollm2_tokenizer).tokenize(TokenizeRequest(request_id="t", info=True))
    info = json.loads(answer.text)
    assert info["tokenizer_class"] == type(smollm2_tokenizer).__name__
    assert info["eos_token"] == smollm2_tokenizer.eos_token
    assert info["chat_template"] == smollm2_tokenizer.chat_template
    assert info["vocab_size"] == len(smollm2_tokenizer)
    assert make_worker(None).tokenize(TokenizeRequest(request_id="t", info=True)).error is not None
