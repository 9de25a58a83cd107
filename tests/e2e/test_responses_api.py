"""OpenAI's Responses API (`/v1/responses`) through the official `openai` client: text, its
stream of typed events, a conversation continued by `previous_response_id` and the stored
responses, JSON Schema output, a function-tool round trip, and what is refused by name."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.server import Server

pytestmark = pytest.mark.slow

CITY = {  # as most clients write schemas: nothing said of other keys
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["name", "population"],
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client(default_server: Server) -> openai.OpenAI:
    return default_server.client(max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def events_of(stream: Any) -> list[Any]:
    return list(stream)


def test_a_response_and_its_stream_say_the_same(client: openai.OpenAI, model: str) -> None:
    asked: dict[str, Any] = {
        "model": model,
        "input": "The capital of France is",
        "max_output_tokens": 6,
        "temperature": 0,
    }
    whole = client.responses.create(**asked)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text and whole.usage.output_tokens == 6
    assert [item.type for item in whole.output] == ["message"]

    events = events_of(client.responses.create(**asked, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert streamed == final.output_text == whole.output_text  # greedy: the same text
    assert events[-4].text == streamed
    assert final.output[0].id == events[2].item.id


def test_previous_response_id_continues_a_stored_conversation(
    client: openai.OpenAI, model: str
) -> None:
    first = client.responses.create(
        model=model, input="My name is Ada.", instructions="Be brief.", max_output_tokens=4
    )
    alone = client.responses.create(model=model, input="What is my name?", max_output_tokens=4)
    follow = client.responses.create(
        model=model,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=4,
    )
    assert follow.previous_response_id == first.id
    # The earlier turn (its input and output, not its instructions) came before this one.
    assert follow.usage.input_tokens > alone.usage.input_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="Hi", previous_response_id=first.id)
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_json_schema_format_gives_json_with_only_its_keys(
    client: openai.OpenAI, model: str
) -> None:
    response = client.responses.create(
        model=model,
        input="Describe Paris as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY}},
        max_output_tokens=64,
        temperature=0,
    )
    assert response.status == "completed"
    document = json.loads(response.output_text)
    jsonschema.validate(document, {**CITY, "additionalProperties": False})


def test_a_function_tool_round_trip(client: openai.OpenAI, model: str) -> None:
    asked: dict[str, Any] = {
        "model": model,
        "input": "What is the weather in Paris?",
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "max_output_tokens": 48,
        "temperature": 0,
    }
    called = client.responses.create(**asked)
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}

    events = events_of(client.responses.create(**asked, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments and done.name == "get_weather"
    assert kinds[-1] == "response.completed"

    answered = client.responses.create(
        model=model,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=4,
    )
    assert [item.type for item in answered.output] == ["message"]
    assert answered.usage.input_tokens > called.usage.input_tokens


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"background": True}, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"truncation": "auto"}, "truncation"),
    ],
)
def test_what_is_not_served_is_refused_by_name(
    client: openai.OpenAI, model: str, fields: dict[str, Any], param: str
) -> None:
    asked = {"model": model, "input": "Hi", "max_output_tokens": 2} | fields
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**asked)
    assert refused.value.body["param"] == param
