"""Text deltas -> OpenAI bodies and stream chunks, and request errors -> HTTP errors."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from services.frontend.api import responses as r
from services.frontend.api.endpoints import CHAT, COMPLETIONS, CallPlan, Endpoint
from services.frontend.api.errors import APIError, api_error, bad_request, unavailable
from shared.protocol import (
    ErrorKind,
    FinishReason,
    ParameterError,
    PromptTokenLogprob,
    RequestError,
    TextDelta,
    TokenLogprob,
    TopLogprob,
)


def entry(token: str, logprob: float, *top: tuple[str, float]) -> TokenLogprob:
    alternatives = [TopLogprob(token_id=i, token=t, logprob=lp) for i, (t, lp) in enumerate(top)]
    return TokenLogprob(token_id=99, token=token, logprob=logprob, rank=1, top=alternatives)


def delta(request_id: str, text: str, **fields: object) -> TextDelta:
    return TextDelta(request_id=request_id, text=text, token_ids=[1] * len(text), **fields)


def finished(index: int, prompt: int, output: int, cached: int = 0) -> r.Choice:
    choice = r.Choice(index)
    choice.absorb(
        delta(
            "x",
            "done",
            finish_reason=FinishReason.STOP,
            num_prompt_tokens=prompt,
            num_output_tokens=output,
            num_cached_tokens=cached,
        )
    )
    return choice


def check_envelope(body: dict, request_id: str, obj: str) -> None:
    assert (body["id"], body["object"], body["model"]) == (request_id, obj, "m")
    assert abs(body["created"] - time.time()) < 5 and isinstance(body["created"], int)


# ------------------------------------------------------------------ choices and usage


def test_choice_absorbs_deltas() -> None:
    choice = r.Choice(3)
    choice.absorb(delta("x", "Hel", num_prompt_tokens=4, num_cached_tokens=2, prompt_text="P"))
    choice.absorb(delta("x", "lo", logprobs=[entry("lo", -0.5)], num_output_tokens=2))
    assert (choice.index, "".join(choice.text), choice.prompt_text) == (3, "Hello", "P")
    assert (choice.num_prompt_tokens, choice.num_output_tokens, choice.num_cached_tokens) == (
        4,
        2,
        2,
    )
    assert choice.num_deltas == 2 and choice.finish_reason is None
    assert [e.token for e in choice.logprobs] == ["lo"]


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (FinishReason.STOP, "stop"),
        (FinishReason.LENGTH, "length"),
        (FinishReason.ABORT, "stop"),
        (FinishReason.ERROR, "error"),
    ],
)
def test_finish_reasons_in_openai_terms(reason: FinishReason, expected: str) -> None:
    choice = r.Choice(0)
    choice.absorb(delta("x", "", finish_reason=reason))
    assert choice.finish_reason == expected


def test_usage_counts_each_prompt_once_however_many_samples() -> None:
    # Two prompts (5 and 7 tokens, 3 and 0 of them cached), two samples each.
    choices = [finished(0, 5, 10, 3), finished(1, 5, 20, 3), finished(2, 7, 1), finished(3, 7, 2)]
    assert r.usage(choices, num_prompts=2) == {
        "prompt_tokens": 12,
        "completion_tokens": 33,
        "total_tokens": 45,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    assert r.usage(choices[:2], num_prompts=1)["prompt_tokens"] == 5
    assert r.usage(choices[::2], num_prompts=2)["prompt_tokens"] == 12


# ------------------------------------------------------------------ completions


def test_completion_body_with_echo_and_logprobs() -> None:
    choice = r.Choice(0)
    prompt = [
        PromptTokenLogprob(5, "Capital", None, None, []),
        PromptTokenLogprob(6, ":", -1.5, 3, [TopLogprob(7, " of", -0.5)]),
    ]
    first = delta(
        "x",
        " Paris",
        prompt_text="Capital:",
        logprobs=[entry(" Par", -0.1, (" Par", -0.1), (" Lon", -2.0)), entry("is", -0.2)],
    )
    first.prompt_logprobs = prompt
    choice.absorb(first)
    choice.absorb(delta("x", ".", finish_reason=FinishReason.LENGTH, num_output_tokens=3))
    body = r.completion_body("cmpl-1", "m", [choice], 1, logprobs=True)
    check_envelope(body, "cmpl-1", "text_completion")
    assert body["choices"] == [
        {
            "index": 0,
            "text": "Capital: Paris.",
            "logprobs": {
                # the prompt's tokens first; the first has nothing before it to be scored on
                "tokens": ["Capital", ":", " Par", "is"],
                "token_logprobs": [None, -1.5, -0.1, -0.2],
                "top_logprobs": [None, {" of": -0.5}, {" Par": -0.1, " Lon": -2.0}, {}],
                "text_offset": [0, 7, 8, 12],
            },
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": [
                None,
                {
                    6: {"logprob": -1.5, "rank": 3, "decoded_token": ":"},
                    7: {"logprob": -0.5, "rank": 1, "decoded_token": " of"},
                },
            ],
        }
    ]
    assert body["usage"]["completion_tokens"] == 3
    assert r.completion_body("cmpl-1", "m", [choice], 1, False)["choices"][0]["logprobs"] is None


def test_completion_chunks_carry_the_echoed_prompt_once() -> None:
    choice = r.Choice(1)
    first = delta("x", " Hi", prompt_text="Say:")
    choice.absorb(first)
    chunk = r.completion_chunk("cmpl-1", "m", choice, first, False)
    check_envelope(chunk, "cmpl-1", "text_completion")
    assert chunk["choices"] == [
        {"index": 1, "text": "Say: Hi", "logprobs": None, "finish_reason": None}
    ]
    last = delta("x", "!", finish_reason=FinishReason.STOP, logprobs=[entry("!", -1.5)])
    choice.absorb(last)
    (out,) = r.completion_chunk("cmpl-1", "m", choice, last, True)["choices"]
    assert (out["text"], out["finish_reason"]) == ("!", "stop")
    assert out["logprobs"] == {
        "tokens": ["!"],
        "token_logprobs": [-1.5],
        "top_logprobs": [{}],
        "text_offset": [0],
    }


# ------------------------------------------------------------------ chat


def test_chat_body_and_its_logprobs() -> None:
    choice = r.Choice(0)
    choice.absorb(delta("x", "é", logprobs=[entry("é", -0.3, ("é", -0.3), ("e", -1.0))]))
    choice.absorb(delta("x", "", finish_reason=FinishReason.STOP, num_prompt_tokens=9))
    body = r.chat_body("chatcmpl-1", "m", [choice], 1, logprobs=True)
    check_envelope(body, "chatcmpl-1", "chat.completion")
    (out,) = body["choices"]
    assert out["message"] == {"role": "assistant", "content": "é"}
    assert out["finish_reason"] == "stop"
    assert out["logprobs"] == {
        "content": [
            {
                "token": "é",
                "logprob": -0.3,
                "bytes": [195, 169],
                "top_logprobs": [
                    {"token": "é", "logprob": -0.3, "bytes": [195, 169]},
                    {"token": "e", "logprob": -1.0, "bytes": [101]},
                ],
            }
        ]
    }
    assert body["usage"]["prompt_tokens"] == 9
    assert r.chat_body("chatcmpl-1", "m", [choice], 1, False)["choices"][0]["logprobs"] is None


def test_chat_chunks_name_the_role_in_each_choices_first_chunk_only() -> None:
    choices = [r.Choice(0), r.Choice(1)]
    deltas = [(0, delta("a", "Hel")), (1, delta("b", "Yo")), (0, delta("a", "lo"))]
    messages = []
    for index, d in deltas:
        choices[index].absorb(d)
        chunk = r.chat_chunk("chatcmpl-1", "m", choices[index], d, False)
        check_envelope(chunk, "chatcmpl-1", "chat.completion.chunk")
        messages.append((chunk["choices"][0]["index"], chunk["choices"][0]["delta"]))
    assert messages == [
        (0, {"role": "assistant", "content": "Hel"}),
        (1, {"role": "assistant", "content": "Yo"}),
        (0, {"content": "lo"}),
    ]


def test_usage_chunk_has_no_choices() -> None:
    usage = r.usage([finished(0, 2, 3)], 1)
    chunk = r.usage_chunk("chatcmpl-1", "m", "chat.completion.chunk", usage)
    check_envelope(chunk, "chatcmpl-1", "chat.completion.chunk")
    assert (chunk["choices"], chunk["usage"]["total_tokens"]) == ([], 5)


def call_plan(endpoint: Endpoint[Any], include_usage: bool = True) -> CallPlan:
    return CallPlan("c", "m", endpoint, [], 1, True, include_usage, False, None)


def test_endpoints_pick_their_builders() -> None:
    choice = finished(0, 2, 3)
    assert COMPLETIONS.response_body(call_plan(COMPLETIONS), [choice])["object"] == (
        "text_completion"
    )
    assert CHAT.response_body(call_plan(CHAT), [choice])["object"] == "chat.completion"
    assert (COMPLETIONS.id_prefix, CHAT.id_prefix) == ("cmpl", "chatcmpl")


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_chunk_stream_ends_with_its_usage_when_asked_then_done(include_usage: bool) -> None:
    for endpoint, obj in ((COMPLETIONS, "text_completion"), (CHAT, "chat.completion.chunk")):
        writer = endpoint.stream_writer(call_plan(endpoint, include_usage))
        closing = writer.closing([finished(0, 2, 3)])
        assert closing[-1] == b"data: [DONE]\n\n"
        if include_usage:
            usage = json.loads(closing[0].removeprefix(b"data: "))
            assert (usage["object"], usage["usage"]["total_tokens"]) == (obj, 5)
        assert len(closing) == 1 + include_usage


# ------------------------------------------------------------------ errors


# kind -> (status, type, param, code, message) for RequestError(kind, "too long", "prompt")
ERROR_CASES = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error", "prompt", None, "too long"),
    ErrorKind.QUEUE_FULL: (
        429,
        "rate_limit_error",
        None,
        "queue_full",
        "the server is overloaded: too long; retry later",
    ),
    ErrorKind.UNAVAILABLE: (
        503,
        "service_unavailable",
        None,
        None,
        "the engine is unavailable: too long",
    ),
    ErrorKind.NOT_FOUND: (404, "not_found_error", "prompt", None, "too long"),
    ErrorKind.INTERNAL: (500, "internal_error", None, None, "too long"),
}


@pytest.mark.parametrize("kind", list(ErrorKind))  # a new kind without a case fails here
def test_api_error_for_every_error_kind(kind: ErrorKind) -> None:
    status, type_, param, code, message = ERROR_CASES[kind]
    error = api_error(RequestError(kind=kind, message="too long", param="prompt"))
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    assert (error.status, error.body()) == (status, body)
    response = error.response()
    assert (response.status_code, json.loads(response.body)) == (status, body)
    if kind is ErrorKind.QUEUE_FULL:  # the OpenAI SDKs wait this long before they retry
        assert response.headers["retry-after"] == "1"


def test_bad_request_and_unavailable() -> None:
    from_exception = bad_request(ParameterError("top_p", "must be in (0, 1]"))
    assert (from_exception.status, from_exception.param) == (400, "top_p")
    assert from_exception.message == "top_p: must be in (0, 1]"
    from_text = bad_request("no", param="x")
    assert (from_text.status, from_text.message, from_text.param) == (400, "no", "x")
    down = unavailable("draining")
    assert (down.status, down.kind, down.message) == (
        503,
        "service_unavailable",
        "the engine is unavailable: draining",
    )
    assert isinstance(down, APIError)


def test_chat_chunks_skip_deltas_with_nothing_to_say() -> None:
    """Text held back (a possible stop string, a tool call not complete yet) sends nothing;
    the first chunk still names the role, and the last still ends the choice."""
    choice = r.Choice(0)
    steps = [
        delta("x", ""),
        delta("x", ""),
        delta("x", "hi"),
        delta("x", ""),
        delta("x", "", finish_reason=FinishReason.STOP),
    ]
    chunks = []
    for step in steps:
        choice.absorb(step)
        chunks.append(r.chat_chunk("c-1", "m", choice, step, logprobs=False))
    assert [c is None for c in chunks] == [False, True, False, True, False]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[4]["choices"][0]["finish_reason"] == "stop"
