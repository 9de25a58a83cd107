"""A chat's thinking in OpenAI shapes: `reasoning_content` (and vLLM 0.26's `reasoning`) in
the message and in stream deltas; and `chat_template_kwargs` read from a chat body onto the
request the tokenizer pool gets."""

from __future__ import annotations

import json

import pytest

from services.frontend.api import responses as r
from services.frontend.api.endpoints import CHAT
from services.frontend.api.openai_types import ChatCompletionRequest, decode_body
from shared.protocol import FinishReason, ParameterError, TextDelta, ToolCallDelta


def delta(text: str, reasoning: str = "", **fields: object) -> TextDelta:
    return TextDelta(request_id="x", text=text, token_ids=[1], reasoning=reasoning, **fields)  # type: ignore[arg-type]


def test_the_message_carries_the_thinking_under_both_names() -> None:
    choice = r.Choice(0)
    for d in [
        delta("", "Two "),
        delta("", "and two."),
        delta("It is 4.", finish_reason=FinishReason.STOP),
    ]:
        choice.absorb(d)
    (out,) = r.chat_body("c-1", "m", [choice], 1, logprobs=False)["choices"]
    assert out["message"] == {
        "role": "assistant",
        "content": "It is 4.",
        "reasoning": "Two and two.",
        "reasoning_content": "Two and two.",
    }


def test_a_message_without_thinking_has_no_reasoning_fields() -> None:
    choice = r.Choice(0)
    choice.absorb(delta("Hi", finish_reason=FinishReason.STOP))
    body = r.chat_body("c-1", "m", [choice], 1, False)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}
    assert "completion_tokens_details" not in body["usage"]


def test_the_usage_counts_the_thinking_tokens_apart() -> None:
    choices = [r.Choice(0), r.Choice(1)]
    choices[0].absorb(delta("", "Two", num_output_tokens=5, num_reasoning_tokens=5))
    choices[0].absorb(delta("4", num_output_tokens=9, num_reasoning_tokens=7))
    choices[1].absorb(delta("4", num_output_tokens=2, num_reasoning_tokens=1))
    counted = r.usage(choices, num_prompts=1)
    assert counted["completion_tokens"] == 11
    assert counted["completion_tokens_details"] == {"reasoning_tokens": 8}


def test_thinking_and_tool_calls_together() -> None:
    choice = r.Choice(0)
    call = ToolCallDelta(index=0, id="call_1", name="f", arguments="{}")
    choice.absorb(delta("", "Use f.", tool_calls=[call], finish_reason=FinishReason.STOP))
    message = r.chat_body("c-1", "m", [choice], 1, False)["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == (None, "Use f.")
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}


def test_stream_chunks_carry_the_thinking_then_the_answer() -> None:
    choice = r.Choice(0)
    steps = [
        delta("", "Two "),
        delta("", ""),  # held back (a possible </think>): nothing to send
        delta("", "and two."),
        delta("It ", "\n"),  # the step where the thinking ends and the answer begins
        delta("is 4.", finish_reason=FinishReason.STOP),
    ]
    sent = []
    for step in steps:
        choice.absorb(step)
        chunk = r.chat_chunk("c-1", "m", choice, step, logprobs=False)
        sent.append(None if chunk is None else chunk["choices"][0]["delta"])
    assert sent == [
        {"role": "assistant", "content": None, "reasoning": "Two ", "reasoning_content": "Two "},
        None,
        {"content": None, "reasoning": "and two.", "reasoning_content": "and two."},
        {"content": "It ", "reasoning": "\n", "reasoning_content": "\n"},
        {"content": "is 4."},
    ]
    json.dumps(sent)  # plain JSON


def read_chat(body: dict[str, object]) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return decode_body(json.dumps(body).encode(), ChatCompletionRequest)


def test_chat_template_kwargs_go_to_the_tokenizer_pool() -> None:
    kwargs = {"enable_thinking": False, "depth": [1, {"a": None}]}
    inputs = CHAT.read(read_chat({"chat_template_kwargs": kwargs}))
    (prompt,) = inputs.prompts
    request = prompt.request("chatcmpl-1", inputs.params, 0.0, 0)
    assert request.chat_template_kwargs == kwargs
    unset = CHAT.read(read_chat({})).prompts[0].request("chatcmpl-2", inputs.params, 0.0, 0)
    assert unset.chat_template_kwargs is None


@pytest.mark.parametrize("value", [["enable_thinking"], "x", 1])
def test_chat_template_kwargs_must_be_an_object(value: object) -> None:
    with pytest.raises(ParameterError) as error:
        read_chat({"chat_template_kwargs": value})
    assert error.value.param == "chat_template_kwargs"
