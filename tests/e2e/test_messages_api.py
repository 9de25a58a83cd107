"""Anthropic's Messages API (`/v1/messages`) through the official `anthropic` client: text, its
stream of named events, a tool-use round trip, stop sequences, count_tokens, and errors in
Anthropic's shape with `x-api-key` auth."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest

from tests.e2e.server import API_KEY, Server

pytestmark = pytest.mark.slow

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client(default_server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=default_server.url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(default_server: Server) -> str:
    return str(default_server.client().models.list().data[0].id)


def test_a_message_and_its_stream_say_the_same(client: anthropic.Anthropic, model: str) -> None:
    asked: dict[str, Any] = {
        "model": model,
        "max_tokens": 6,
        "extra_body": {"temperature": 0},
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "The capital of France is"}],
    }
    whole = client.messages.create(**asked)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 6
    [block] = whole.content
    assert block.type == "text" and block.text

    with client.messages.stream(**asked) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.content[0].text == block.text  # greedy: the same text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6


def test_a_stop_sequence_is_named(client: anthropic.Anthropic, model: str) -> None:
    asked: dict[str, Any] = {
        "model": model,
        "max_tokens": 32,
        "extra_body": {"temperature": 0},
        "messages": [{"role": "user", "content": "Count from one to ten in words."}],
    }
    free = client.messages.create(**asked).content[0].text
    words = free.split()
    word = words[len(words) // 2]
    stopped = client.messages.create(**asked, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == free[: free.index(word)]  # greedy: cut at its first


def test_a_tool_use_round_trip(client: anthropic.Anthropic, model: str) -> None:
    asked: dict[str, Any] = {
        "model": model,
        "max_tokens": 48,
        "extra_body": {"temperature": 0},
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    }
    called = client.messages.create(**asked)
    assert called.stop_reason == "tool_use"
    [use] = [b for b in called.content if b.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city"}
    assert use.id.startswith("toolu_")

    with client.messages.stream(**asked) as stream:
        streamed = stream.get_final_message()
    [streamed_use] = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_use.input == use.input

    answered = client.messages.create(
        model=model,
        max_tokens=4,
        messages=[
            asked["messages"][0],
            {"role": "assistant", "content": called.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
            },
        ],
    )
    assert answered.content[0].type == "text"
    assert answered.usage.input_tokens > called.usage.input_tokens


def test_an_output_format_gives_json_with_only_its_keys(
    client: anthropic.Anthropic, model: str
) -> None:
    schema = {"type": "object", "properties": WEATHER_TOOL["input_schema"]["properties"]}
    message = client.messages.create(
        model=model,
        max_tokens=32,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        messages=[{"role": "user", "content": "Name a city as JSON."}],
        extra_body={"temperature": 0},
    )
    assert set(json.loads(message.content[0].text)) <= {"city"}


def test_count_tokens_counts_what_a_message_would_take(
    client: anthropic.Anthropic, model: str
) -> None:
    messages = [{"role": "user", "content": "The capital of France is"}]
    counted = client.messages.count_tokens(model=model, system="Be brief.", messages=messages)
    sent = client.messages.create(model=model, max_tokens=1, system="Be brief.", messages=messages)
    assert counted.input_tokens == sent.usage.input_tokens > 0


def test_errors_take_anthropics_shape(default_server: Server, model: str) -> None:
    unkeyed = anthropic.Anthropic(base_url=default_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        unkeyed.messages.create(
            model=model, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "authentication_error"
    client = anthropic.Anthropic(base_url=default_server.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model=model,
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
        )
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="nope", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
