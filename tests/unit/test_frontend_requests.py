"""Generate bodies -> sub-requests: the frontend's validation, with no server and no engine."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from services.frontend.api.endpoints import CHAT, COMPLETIONS, Endpoint
from services.frontend.api.errors import APIError
from services.frontend.api.limits import RequestLimits
from services.frontend.api.validation import CallPlan, Served, plan_call
from shared.config import Config
from shared.ipc import encode
from shared.protocol import ChatMessage

MODEL = "SmolLM2-135M-Instruct"
MAX_N = Config().max_n


def plan(endpoint: Endpoint[Any], body: dict[str, Any] | bytes, **config: Any) -> CallPlan:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    settings = Config(**config)
    served = Served(MODEL, RequestLimits.of(settings), settings.request_timeout)
    return plan_call(endpoint, raw, served, "call-1", arrival_time=123.0)


def refusal(endpoint: Endpoint[Any], body: dict[str, Any] | bytes, **config: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        plan(endpoint, body, **config)
    return caught.value


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"messages": list(messages), **fields}


USER_HI = {"role": "user", "content": "Hi"}

# ------------------------------------------------------------------ completions


def test_one_prompt_is_one_sub_request_with_completion_defaults() -> None:
    call = plan(COMPLETIONS, {"prompt": "Hello"})
    (sub,) = call.sub_requests
    assert (sub.request_id, sub.prompt, sub.prompt_token_ids, sub.messages) == (
        "call-1-0",
        "Hello",
        None,
        None,
    )
    assert (sub.echo, sub.arrival_time) == (False, 123.0)
    assert (sub.sampling_params.max_tokens, sub.sampling_params.n) == (16, 1)
    assert sub.sampling_params.temperature == 1.0 and sub.sampling_params.logprobs is None
    assert (call.request_id, call.num_prompts, call.stream, call.include_usage) == (
        "call-1",
        1,
        False,
        False,
    )
    assert (call.model, call.logprobs, call.endpoint) == (MODEL, False, COMPLETIONS)


def test_prompts_times_n_fan_out_with_ids_and_seeds() -> None:
    call = plan(COMPLETIONS, {"prompt": ["A", "B"], "n": 3, "seed": 10, "max_tokens": 5})
    assert [s.request_id for s in call.sub_requests] == [f"call-1-{i}" for i in range(6)]
    assert [s.prompt for s in call.sub_requests] == ["A", "A", "A", "B", "B", "B"]
    assert [s.sampling_params.seed for s in call.sub_requests] == [10, 11, 12] * 2
    assert {(s.sampling_params.n, s.sampling_params.max_tokens) for s in call.sub_requests} == {
        (1, 5)
    }
    assert call.num_prompts == 2


def test_unseeded_samples_stay_unseeded() -> None:
    call = plan(COMPLETIONS, {"prompt": "A", "n": 2})
    assert [s.sampling_params.seed for s in call.sub_requests] == [None, None]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_token_id_prompts(prompt: list[Any], expected: list[list[int]]) -> None:
    call = plan(COMPLETIONS, {"prompt": prompt})
    assert [s.prompt_token_ids for s in call.sub_requests] == expected
    assert all(s.prompt is None for s in call.sub_requests)


def test_echo_is_set_on_every_sub_request() -> None:
    call = plan(COMPLETIONS, {"prompt": [[5], [7, 8]], "echo": True, "n": 2})
    assert [s.echo for s in call.sub_requests] == [True] * 4
    assert [s.prompt_token_ids for s in call.sub_requests] == [[5], [5], [7, 8], [7, 8]]
    assert plan(COMPLETIONS, {"prompt": "A"}).sub_requests[0].echo is False


def test_completion_logprobs_and_streaming_options() -> None:
    call = plan(
        COMPLETIONS,
        {"prompt": "A", "logprobs": 2, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert call.sub_requests[0].sampling_params.logprobs == 2
    assert (call.logprobs, call.stream, call.include_usage) == (True, True, True)
    assert plan(COMPLETIONS, {"prompt": "A", "logprobs": 0}).logprobs is True


def test_vllm_extras_reach_the_sampling_params() -> None:
    params = (
        plan(
            COMPLETIONS,
            {
                "prompt": "A",
                "top_k": -1,
                "ignore_eos": True,
                "min_tokens": 2,
                "stop": "\n",
                "stop_token_ids": [5],
                "logit_bias": {"42": 3.5},
            },
        )
        .sub_requests[0]
        .sampling_params
    )
    assert params.top_k is None and params.ignore_eos and params.min_tokens == 2
    assert (params.stop, params.stop_token_ids, params.logit_bias) == (["\n"], [5], {42: 3.5})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", "body"),
        (b"[]", "body"),
        ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 2}, "top_p"),
        ({"prompt": "hi", "top_k": 0.5}, "top_k"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "n": MAX_N + 1}, "n"),
        ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "hi", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"1": 101}}, "logit_bias"),
        # Found by tests/e2e/test_http_fuzz.py: ids past 64 bits were a 500 (the wire refused
        # them); the others int() read, and the scheduler refused later or never.
        ({"prompt": "hi", "logit_bias": {"9" * 20: 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"-1": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {" 1": 1}}, "logit_bias"),
        ({"prompt": "hi", "seed": 2**64 - 1, "n": 2}, "seed"),  # seed + 1 was a 500
        ({"prompt": "hi", "seed": 2**63}, "seed"),
        ({"prompt": "hi", "stop_token_ids": [2**64]}, "stop_token_ids"),  # a 500 (fuzz)
        ({"prompt": "hi", "priority": -(2**63) - 1}, "priority"),
        ({"prompt": "hi", "top_k": 2**70}, "top_k"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": []}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "hi", "suffix": "x"}, "suffix"),
        ({"prompt": "hi", "best_of": 2}, "best_of"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # only echo takes 0
        ({"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
        ({"prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format"),
        ({"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"prompt": "hi", "guided_choice": []}, "guided_choice"),
        (
            {"prompt": "hi", "structured_outputs": {"regex": "a", "json_object": True}},
            "structured_outputs",
        ),
        ({"prompt": "hi", "structured_outputs": {"pattern": "a"}}, "structured_outputs"),
        ({"prompt": "hi", "min_tokens": 1, "guided_regex": "a"}, "min_tokens"),
    ],
)
def test_bad_completion_bodies_are_400_naming_the_param(
    body: dict[str, Any] | bytes, param: str
) -> None:
    error = refusal(COMPLETIONS, body)
    assert (error.status, error.kind, error.param) == (400, "invalid_request_error", param)
    assert error.message


def test_int64_seeds_fan_out_within_what_the_wire_carries() -> None:
    for seed in (2**63 - 1, -(2**63)):
        subs = plan(COMPLETIONS, {"prompt": "hi", "seed": seed, "n": MAX_N}).sub_requests
        assert [s.sampling_params.seed for s in subs] == [seed + k for k in range(MAX_N)]
        for sub in subs:
            encode(sub)  # msgpack: 64 bits, signed or not


def test_best_of_equal_to_n_is_accepted() -> None:
    assert len(plan(COMPLETIONS, {"prompt": "hi", "n": 2, "best_of": 2}).sub_requests) == 2


def test_unknown_model_is_404_before_any_parameter_check() -> None:
    error = refusal(COMPLETIONS, {"prompt": "hi", "model": "gpt-4", "temperature": -1})
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    assert error.message == "The model `gpt-4` does not exist."
    assert refusal(CHAT, chat(USER_HI, model="gpt-4")).code == "model_not_found"
    assert plan(COMPLETIONS, {"prompt": "hi", "model": MODEL}).sub_requests


# ------------------------------------------------------------------ chat


def test_chat_is_one_prompt_of_messages_with_n_samples() -> None:
    call = plan(
        CHAT, chat({"role": "system", "content": "Be terse."}, USER_HI, n=2, seed=0, max_tokens=7)
    )
    assert [s.request_id for s in call.sub_requests] == ["call-1-0", "call-1-1"]
    assert [s.sampling_params.seed for s in call.sub_requests] == [0, 1]
    expected = [ChatMessage("system", "Be terse."), ChatMessage("user", "Hi")]
    assert all(s.messages == expected for s in call.sub_requests)
    sub = call.sub_requests[0]
    assert (sub.prompt, sub.prompt_token_ids, sub.echo) == (None, None, False)
    assert (sub.sampling_params.max_tokens, call.num_prompts, call.logprobs) == (7, 1, False)
    assert call.endpoint is CHAT


def test_chat_max_tokens_defaults_to_none_and_max_completion_tokens_wins() -> None:
    assert plan(CHAT, chat(USER_HI)).sub_requests[0].sampling_params.max_tokens is None
    both = chat(USER_HI, max_tokens=7, max_completion_tokens=3)
    assert plan(CHAT, both).sub_requests[0].sampling_params.max_tokens == 3


@pytest.mark.parametrize("role", ["system", "user", "assistant", "developer"])
def test_chat_roles_accepted(role: str) -> None:
    call = plan(CHAT, chat({"role": role, "content": "x"}))
    assert call.sub_requests[0].messages == [ChatMessage(role, "x")]


def test_chat_content_parts_are_joined_and_none_is_empty() -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    call = plan(CHAT, chat({"role": "user", "content": parts}, {"role": "assistant"}))
    assert call.sub_requests[0].messages == [
        ChatMessage("user", "Hello, world"),
        ChatMessage("assistant", ""),
    ]


@pytest.mark.parametrize(
    ("logprobs", "top_logprobs", "expected"),
    [(False, None, None), (True, None, 0), (True, 3, 3), (True, 0, 0)],
)
def test_chat_logprobs(logprobs: bool, top_logprobs: int | None, expected: int | None) -> None:
    call = plan(CHAT, chat(USER_HI, logprobs=logprobs, top_logprobs=top_logprobs))
    assert call.sub_requests[0].sampling_params.logprobs == expected
    assert call.logprobs is logprobs


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        (chat(), "messages"),
        (chat({"role": "tool", "content": "x"}), "messages"),  # no tool_call_id
        (chat({"role": "function", "content": "x"}), "messages"),
        (chat({"content": "x"}), "messages"),
        (chat({"role": "user", "content": 5}), "messages"),
        (chat({"role": "user", "content": [{"type": "image_url"}]}), "messages"),
        (chat(USER_HI, top_logprobs=2), "top_logprobs"),
        (chat(USER_HI, logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(USER_HI, logprobs=2), "logprobs"),
        (chat(USER_HI, max_tokens=0), "max_tokens"),
        (chat(USER_HI, max_completion_tokens=-1), "max_tokens"),
        (chat(USER_HI, max_completion_tokens=0, max_tokens=5), "max_tokens"),
        (chat(USER_HI, temperature="hot"), "temperature"),
        (chat(USER_HI, n=MAX_N + 1), "n"),
        # OpenAI fields not served are refused by name, never ignored
        (chat(USER_HI, functions=[{"name": "f"}]), "functions"),
        (chat(USER_HI, function_call="auto"), "function_call"),
        (chat(USER_HI, prediction={"type": "content", "content": "x"}), "prediction"),
        (chat(USER_HI, modalities=["text", "audio"]), "modalities"),
        (chat(USER_HI, tool_choice="required"), "tool_choice"),  # without tools
        (
            chat(
                {
                    "role": "user",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}
                    ],
                }
            ),
            "messages",
        ),
    ],
)
def test_bad_chat_bodies_are_400_naming_the_param(body: dict[str, Any], param: str) -> None:
    error = refusal(CHAT, body)
    assert (error.status, error.kind, error.param) == (400, "invalid_request_error", param)


# ------------------------------------------------------------------ operator limits


@pytest.mark.parametrize(
    ("endpoint", "body", "limit", "param", "flag"),
    [
        (
            COMPLETIONS,
            {"prompt": ["a", "b", "c"]},
            {"max_num_prompts": 2},
            "prompt",
            "max-num-prompts",
        ),
        (COMPLETIONS, {"prompt": "x" * 11}, {"max_prompt_chars": 10}, "prompt", "max-prompt-chars"),
        (
            CHAT,
            chat(USER_HI, USER_HI, USER_HI),
            {"max_num_messages": 2},
            "messages",
            "max-num-messages",
        ),
        (
            CHAT,
            chat({"role": "user", "content": "y" * 11}),
            {"max_prompt_chars": 10},
            "messages",
            "max-prompt-chars",
        ),
        (COMPLETIONS, {"prompt": "hi", "n": 3}, {"max_n": 2}, "n", "max-n"),
        (
            COMPLETIONS,
            {"prompt": "hi", "max_tokens": 101},
            {"max_tokens_limit": 100},
            "max_tokens",
            "max-tokens-limit",
        ),
        (
            CHAT,
            chat(USER_HI, max_completion_tokens=101),
            {"max_tokens_limit": 100},
            "max_tokens",
            "max-tokens-limit",
        ),
        (
            COMPLETIONS,
            {"prompt": "hi", "logprobs": 6},
            {"max_logprobs": 5},
            "logprobs",
            "max-logprobs",
        ),
        (
            CHAT,
            chat(USER_HI, logprobs=True, top_logprobs=6),
            {"max_logprobs": 5},
            "top_logprobs",
            "max-logprobs",
        ),
        (
            COMPLETIONS,
            {"prompt": "hi", "stop": ["a", "b", "c"]},
            {"max_stop_strings": 2},
            "stop",
            "max-stop-strings",
        ),
        (
            COMPLETIONS,
            {"prompt": "hi", "stop": "abcd"},
            {"max_stop_string_chars": 3},
            "stop",
            "max-stop-string-chars",
        ),
        (
            COMPLETIONS,
            {"prompt": "hi", "logit_bias": {"1": 1, "2": 1}},
            {"max_logit_bias": 1},
            "logit_bias",
            "max-logit-bias",
        ),
    ],
)
def test_a_request_past_an_operator_limit_is_400_naming_param_and_flag(
    endpoint: Endpoint[Any], body: dict[str, Any], limit: dict[str, int], param: str, flag: str
) -> None:
    error = refusal(endpoint, body, **limit)
    assert (error.status, error.param) == (400, param)
    assert f"--{flag}" in error.message
    at_limit = {name: value + 1 for name, value in limit.items()}
    assert plan(endpoint, body, **at_limit).sub_requests  # one more allowed: accepted


def test_the_timeout_is_the_body_s_within_the_server_s() -> None:
    assert plan(COMPLETIONS, {"prompt": "hi"}).timeout is None
    assert plan(COMPLETIONS, {"prompt": "hi", "timeout": 5}).timeout == 5
    assert plan(COMPLETIONS, {"prompt": "hi"}, request_timeout=30).timeout == 30
    assert plan(COMPLETIONS, {"prompt": "hi", "timeout": 50}, request_timeout=30).timeout == 30
    assert plan(CHAT, chat(USER_HI, timeout=2.5), request_timeout=30).timeout == 2.5
    for bad in (0, -1):
        assert refusal(COMPLETIONS, {"prompt": "hi", "timeout": bad}).param == "timeout"


def test_the_priority_reaches_every_sub_request() -> None:
    call = plan(COMPLETIONS, {"prompt": ["a", "b"], "n": 2, "priority": -3})
    assert [s.priority for s in call.sub_requests] == [-3] * 4
    assert plan(CHAT, chat(USER_HI)).sub_requests[0].priority == 0


def test_a_chat_template_in_a_request_is_refused() -> None:
    error = refusal(CHAT, chat(USER_HI, chat_template="{{ 7 * 7 }}"))
    assert (error.status, error.param) == (400, "chat_template")


def test_a_field_kvflow_does_not_serve_is_named_in_the_log_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from services.frontend.api.openai_types import CompletionRequest
    from services.frontend.api.validation import decode

    body = b'{"prompt": "hi", "max_tokens": 3, "service_tier": "flex", "zz_new": {"a": [1]}}'
    with caplog.at_level(logging.WARNING):
        first = decode(body, CompletionRequest)
        decode(body, CompletionRequest)
    assert first.max_tokens == 3
    named = [r.getMessage() for r in caplog.records if "does not serve" in r.getMessage()]
    assert len(named) == 2  # each field once, not once per request
    assert "'service_tier'" in named[0] and "'zz_new'" in named[1]
    assert not any("'max_tokens'" in m or "'prompt'" in m for m in named)
