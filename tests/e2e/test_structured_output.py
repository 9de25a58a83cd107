"""Structured output and tool calling through a real `kvflow serve`, driven by the official
`openai` client (httpx where a raw error body is the point).

The model is a tiny random-weight Llama with SmolLM2's tokenizer and a Hermes-style tool chat
template (tests/tool_chat_model.py). Its unconstrained output is noise, so every output that
parses here was made valid by the grammar, never by the model. Schemas are bounded (string
lengths, enums, item counts) so that noise inside them still ends well within `max_tokens`.

One server serves the module (tests/e2e/conftest.py's `tool_server`, which
test_prompt_logprobs_http.py shares), with the hermes tool-call parser for `tool_choice: "auto"`
and only 64 KV blocks (one max_model_len), so that a batch of long constrained outputs must be
preempted and resumed. A few checks drive a service's core instead, where the server cannot
show the behaviour within a test; each says why.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessage
from pydantic import BaseModel, Field

from tests.e2e.server import Server
from tests.tool_chat_model import TOOL_CHAT_TEMPLATE

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["utc_offset"],
    "additionalProperties": False,
}
GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": WEATHER_PARAMETERS,
    },
}
GET_TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}}
PARAMETERS_BY_NAME = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
CALL_WEATHER = {"type": "function", "function": {"name": "get_weather"}}

# A Hermes tool call after some text, forced by a regex (the model cannot write it itself).
# Written by hand for llguidance's regex engine; equivalent to re.escape(FORCED_TEXT).
FORCED_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
)
FORCED_REGEX = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n'
    r"</tool_call>"
)


class Sky(StrEnum):
    SUNNY = "sunny"
    CLOUDY = "cloudy"
    RAINY = "rainy"


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    temperature: int = Field(ge=-50, le=60)
    sky: Sky
    unit: Literal["celsius", "fahrenheit"]
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)


class GetWeather(BaseModel):
    city: str = Field(max_length=10)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def server(tool_server: Server) -> Server:
    return tool_server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client(max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tool_tokenizer(smollm2_tokenizer: Any) -> Any:
    """The tool chat model's tokenizer: SmolLM2's, with the Hermes-style tool template."""
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def weather_call(client: openai.OpenAI, model: str) -> ChatCompletionMessage:
    """The assistant message of a get_weather call forced by a named tool_choice."""
    response = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=[GET_WEATHER, GET_TIME],
        tool_choice=CALL_WEATHER,
        max_tokens=150,
        seed=0,
    )
    assert response.choices[0].finish_reason == "stop"  # a named call ends as "stop"
    return response.choices[0].message


# ---------------------------------------------------------------------------- response formats


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (0.8, 1), (1.5, 2)])
def test_parse_returns_the_pydantic_model(
    client: openai.OpenAI, model: str, temperature: float, seed: int
) -> None:
    response = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Forecast for Paris, as JSON."}],
        response_format=Forecast,
        max_tokens=300,
        temperature=temperature,
        seed=seed,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    forecast = choice.message.parsed
    assert isinstance(forecast, Forecast)  # the SDK validated it with pydantic
    assert len(forecast.city) <= 12 and -50 <= forecast.temperature <= 60
    assert len(forecast.tags) <= 3 and all(len(tag) <= 8 for tag in forecast.tags)


def test_json_object_is_an_object_even_when_bias_pushes_elsewhere(
    client: openai.OpenAI, model: str, smollm2_tokenizer: Any
) -> None:
    # Why the bias: inside a free JSON object the model's noise rarely closes a string, so
    # '"' and '}' are made likely. Unconstrained, a strong bias on '}' starts the output with
    # it; the grammar's mask comes before logit_bias, so the output must still be an object.
    [quote] = smollm2_tokenizer.encode('"', add_special_tokens=False)
    [brace] = smollm2_tokenizer.encode("}", add_special_tokens=False)
    bias = {str(quote): 15.0, str(brace): 15.0}
    unconstrained = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, seed=0, logit_bias={str(brace): 30.0}
    )
    assert unconstrained.choices[0].message.content.startswith("}")
    response = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        logit_bias=bias,
        max_tokens=100,
        n=4,
        seed=0,
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content), dict)


def test_json_schema_as_a_raw_dict_validates(client: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
            "levels": {"type": "array", "items": {"enum": ["low", "high"]}, "maxItems": 4},
        },
        "required": ["code", "count", "ok", "levels"],
        "additionalProperties": False,
    }
    response = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "report", "schema": schema, "strict": True},
        },
        max_tokens=250,
        n=2,
        seed=3,
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


# ---------------------------------------------------------------------------- vLLM's fields

COLORS = ["red", "green", "blue", "light blue"]
COLORS_REGEX = "red|green|blue|light blue"
CODE_REGEX = r"[0-9]{3}-[a-z]{2}"  # the same in llguidance and Python's re


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(
    ("extra_body", "expected"),
    [
        ({"guided_choice": COLORS}, COLORS_REGEX),
        ({"guided_regex": CODE_REGEX}, CODE_REGEX),
        ({"structured_outputs": {"choice": COLORS}}, COLORS_REGEX),
        ({"structured_outputs": {"regex": CODE_REGEX}}, CODE_REGEX),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}}, r"x[0-9]{2}"),  # GBNF
        ({"guided_grammar": 'start: "y" /[a-c]{1,3}/ "!"\n'}, r"y[a-c]{1,3}!"),  # Lark
    ],
    ids=["guided_choice", "guided_regex", "choice", "regex", "gbnf", "lark"],
)
def test_vllm_fields_constrain_both_endpoints(
    client: openai.OpenAI, model: str, endpoint: str, extra_body: dict, expected: str
) -> None:
    """Each output matches `expected`, the same language as a Python regex."""
    common: dict[str, Any] = dict(
        model=model, max_tokens=24, n=4, temperature=1.5, seed=7, extra_body=extra_body
    )
    if endpoint == "chat":
        response = client.chat.completions.create(messages=MESSAGES, **common)
        texts = [c.message.content for c in response.choices]
    else:
        response = client.completions.create(prompt="Answer:", **common)
        texts = [c.text for c in response.choices]
    assert all(c.finish_reason == "stop" for c in response.choices)
    assert all(re.fullmatch(expected, text) for text in texts), texts


def test_choices_with_quotes_backslashes_and_newlines_come_back_byte_for_byte(
    client: openai.OpenAI, model: str
) -> None:
    for choice in ['say "hi"', "back\\slash", "tab\tand\nnewline", "日本 🍕", "a{1}|b*"]:
        response = client.completions.create(
            model=model, prompt="Pick:", max_tokens=24, extra_body={"guided_choice": [choice]}
        )
        assert response.choices[0].text == choice


# ---------------------------------------------------------------------------- tools


def test_named_tool_choice_calls_that_tool(weather_call: ChatCompletionMessage) -> None:
    [call] = weather_call.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather")
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    assert weather_call.content is None


def test_named_pydantic_tool_gets_parsed_arguments(client: openai.OpenAI, model: str) -> None:
    response = client.chat.completions.parse(
        model=model,
        messages=MESSAGES,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
        max_tokens=150,
        seed=1,
    )
    [call] = response.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_calls_the_given_tools(
    client: openai.OpenAI, model: str, parallel: bool
) -> None:
    response = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=[GET_WEATHER, GET_TIME],
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=200,
        n=2,
        seed=11,
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        assert len(calls) >= 1 if parallel else len(calls) == 1
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            arguments = json.loads(call.function.arguments)
            jsonschema.validate(arguments, PARAMETERS_BY_NAME[call.function.name])
        assert len({call.id for call in calls}) == len(calls)


def test_tool_result_round_trip(
    client: openai.OpenAI,
    model: str,
    weather_call: ChatCompletionMessage,
    tool_tokenizer: Any,
) -> None:
    [call] = weather_call.tool_calls
    conversation = [
        *MESSAGES,
        weather_call,  # as the SDK returned it, the way OpenAI's docs send it back
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    answers = ["It is 21 degrees.", "It is warm."]
    response = client.chat.completions.create(
        model=model,
        messages=conversation,
        tools=[GET_WEATHER],
        max_tokens=24,
        seed=0,
        extra_body={"guided_choice": answers},
    )
    choice = response.choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("stop", None)
    assert choice.message.content in answers
    # The call and its result reached the prompt, rendered by the model's chat template.
    # Chat templates take a call's arguments as an object (they write it with tojson).
    arguments = json.loads(call.function.arguments)
    hf_call = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }
    assistant = {"role": "assistant", "content": None, "tool_calls": [hf_call]}
    rendered = tool_tokenizer.apply_chat_template(
        [*MESSAGES, assistant, conversation[-1]],
        tools=[GET_WEATHER],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert '"temperature": 21' in rendered and "<tool_call>" in rendered
    num_tokens = len(tool_tokenizer.encode(rendered, add_special_tokens=False))
    assert response.usage.prompt_tokens == num_tokens


def test_tokenize_counts_a_tool_conversation_as_the_chat_does(
    server: Server, client: openai.OpenAI, model: str
) -> None:
    conversation = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    chat = client.chat.completions.create(model=model, messages=conversation, max_tokens=1)
    tokenized = httpx.post(
        f"{server.url}/tokenize", json={"messages": conversation}, headers=server.headers()
    )
    assert tokenized.status_code == 200
    assert tokenized.json()["count"] == chat.usage.prompt_tokens


# ---------------------------------------------------------------------------- streaming


@dataclass
class Streamed:
    """A chat stream put together."""

    content: str
    calls: list[Any]  # ChoiceDeltaToolCall, by index: the first piece, arguments added up
    first_pieces: list[Any]  # the first piece of each call, as it came
    finish_reason: str | None
    usage: CompletionUsage | None


def read_stream(stream: Any) -> Streamed:
    """Accumulates tool calls by index as the openai SDK's docs show (one choice)."""
    content, finish_reason, usage = "", None, None
    calls: dict[int, Any] = {}
    first_pieces: dict[int, Any] = {}
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                if piece.index not in calls:
                    first_pieces[piece.index] = piece.model_copy(deep=True)
                    calls[piece.index] = piece
                else:
                    calls[piece.index].function.arguments += piece.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return Streamed(
        content,
        [calls[i] for i in sorted(calls)],
        [first_pieces[i] for i in sorted(first_pieces)],
        finish_reason,
        usage,
    )


@pytest.mark.parametrize(
    ("tool_choice", "finish_reason"),
    [(CALL_WEATHER, "stop"), ("required", "tool_calls")],
    ids=["named", "required"],
)
def test_streamed_tool_calls_add_up_to_the_whole_answer(
    client: openai.OpenAI, model: str, tool_choice: Any, finish_reason: str
) -> None:
    common: dict[str, Any] = dict(
        model=model,
        messages=MESSAGES,
        tools=[GET_WEATHER, GET_TIME],
        tool_choice=tool_choice,
        max_tokens=200,
        seed=5,
    )
    whole = client.chat.completions.create(**common).choices[0]
    streamed = read_stream(
        client.chat.completions.create(
            **common, stream=True, stream_options={"include_usage": True}
        )
    )
    assert streamed.finish_reason == whole.finish_reason == finish_reason
    assert streamed.content == ""
    for piece in streamed.first_pieces:
        assert piece.id.startswith("call_") and piece.type == "function"
        assert piece.function.name in PARAMETERS_BY_NAME and piece.function.arguments == ""
    calls = streamed.calls
    assert [c.index for c in calls] == list(range(len(calls))) and calls
    assert [(c.type, c.function.name) for c in calls] == [
        (c.type, c.function.name) for c in whole.message.tool_calls
    ]
    for call in calls:
        jsonschema.validate(
            json.loads(call.function.arguments), PARAMETERS_BY_NAME[call.function.name]
        )
    usage = streamed.usage
    assert usage is not None and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_sdk_stream_helper_parses_a_response_format(client: openai.OpenAI, model: str) -> None:
    with client.chat.completions.stream(
        model=model, messages=MESSAGES, response_format=GetWeather, max_tokens=150, seed=2
    ) as stream:
        for _event in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "stop"
    assert isinstance(final.choices[0].message.parsed, GetWeather)


# ---------------------------------------------------------------------------- auto (hermes)


def test_auto_reads_a_hermes_tool_call_after_content(client: openai.OpenAI, model: str) -> None:
    assert re.fullmatch(FORCED_REGEX, FORCED_TEXT)  # the regex says what the text says
    common: dict[str, Any] = dict(
        model=model,
        messages=MESSAGES,
        tools=[GET_WEATHER],
        tool_choice="auto",
        max_tokens=80,
        seed=0,
        extra_body={"structured_outputs": {"regex": FORCED_REGEX}},
    )
    whole = client.chat.completions.create(**common).choices[0]
    assert (whole.finish_reason, whole.message.content) == ("tool_calls", "Let me check.")
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    streamed = read_stream(client.chat.completions.create(**common, stream=True))
    assert (streamed.finish_reason, streamed.content) == ("tool_calls", "Let me check.")
    [call] = streamed.calls
    [first] = streamed.first_pieces
    assert first.id.startswith("call_") and first.type == "function"
    assert (first.function.name, first.function.arguments) == ("get_weather", "")
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def forced_call_regex(city: str) -> str:
    """A regex that matches one Hermes get_weather call for `city` (a plain word) alone."""
    arguments = r'\{"city": "' + city + r'"\}'
    return r'<tool_call>\n\{"name": "get_weather", "arguments": ' + arguments + r"\}\n</tool_call>"


def test_auto_without_parallel_calls_keeps_the_first(client: openai.OpenAI, model: str) -> None:
    two_calls = forced_call_regex("Paris") + r"\n" + forced_call_regex("Rome")
    for parallel, cities in [(True, ["Paris", "Rome"]), (False, ["Paris"])]:
        response = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            tools=[GET_WEATHER],
            parallel_tool_calls=parallel,  # tool_choice: "auto" by default with tools
            max_tokens=100,
            extra_body={"guided_regex": two_calls},
        )
        message = response.choices[0].message
        assert response.choices[0].finish_reason == "tool_calls"
        assert [json.loads(c.function.arguments)["city"] for c in message.tool_calls] == cities


def test_tool_choice_none_leaves_a_call_in_the_content(client: openai.OpenAI, model: str) -> None:
    response = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=[GET_WEATHER],
        tool_choice="none",
        max_tokens=80,
        extra_body={"guided_regex": FORCED_REGEX},
    )
    choice = response.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("stop", FORCED_TEXT)
    assert choice.message.tool_calls is None


# ---------------------------------------------------------------------------- preemption


def test_constrained_outputs_survive_preemption(
    server: Server, client: openai.OpenAI, model: str
) -> None:
    # Eight prompts of ~100 tokens with outputs of 61 need more than the server's 64 blocks
    # (1024 tokens) at once: some are preempted and recomputed, and the grammar state of each
    # must be rebuilt from the tokens it already has.
    regex = r"(x[0-9]){30}"
    prompts = [f"Request {i}: " + "count the numbers " * 24 for i in range(8)]
    before = server.wait_idle().get("num_preemptions_total", 0)
    response = client.completions.create(
        model=model, prompt=prompts, max_tokens=80, seed=0, extra_body={"guided_regex": regex}
    )
    assert response.usage.total_tokens > 64 * 16
    assert server.wait_idle()["num_preemptions_total"] > before
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert re.fullmatch(regex, choice.text)


# ---------------------------------------------------------------------------- bad input

BAD_BODIES = [
    pytest.param(
        "response_format",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "strnig"}},
            }
        },
        id="invalid-json-schema",
    ),
    pytest.param("guided_regex", {"guided_regex": "[0-9]+(a"}, id="invalid-regex"),
    pytest.param(
        "guided_json",
        {"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}},
        id="two-structured-outputs",
    ),
    pytest.param(
        "structured_outputs",
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        id="two-kinds-in-structured-outputs",
    ),
    pytest.param("guided_choice", {"guided_choice": []}, id="no-choices"),
    pytest.param(
        "min_tokens",
        {"response_format": {"type": "json_object"}, "min_tokens": 2},
        id="min-tokens-with-structured-output",
    ),
    pytest.param(
        "tool_choice",
        {"tools": [GET_WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        id="unknown-named-tool",
    ),
    pytest.param("tool_choice", {"tool_choice": "required"}, id="required-without-tools"),
    pytest.param(
        "tools",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"properties": {"a": {"type": "strnig"}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        id="invalid-tool-parameters",
    ),
    pytest.param(  # response_format gives way to a forced call; vLLM's own fields do not
        "structured_outputs",
        {
            "tools": [GET_WEATHER],
            "tool_choice": "required",
            "structured_outputs": {"json": {"type": "object"}},
        },
        id="structured-outputs-with-required-tools",
    ),
    pytest.param(
        "messages",
        {"messages": [*MESSAGES, {"role": "tool", "content": "21 degrees"}]},
        id="tool-message-without-tool-call-id",
    ),
]
CHAT_ONLY_FIELDS = {"tools", "tool_choice", "messages"}
BAD_REQUESTS = [
    pytest.param(endpoint, *case.values, id=f"{endpoint.removesuffix('/completions')}-{case.id}")
    for case in BAD_BODIES
    for endpoint in ("chat/completions", "completions")
    if endpoint == "chat/completions" or not CHAT_ONLY_FIELDS & set(case.values[1])
]


@pytest.mark.parametrize(("endpoint", "param", "fields"), BAD_REQUESTS)
def test_bad_structured_output_is_a_400_naming_the_param(
    server: Server, model: str, endpoint: str, param: str, fields: dict[str, Any]
) -> None:
    prompt = {"messages": MESSAGES} if endpoint == "chat/completions" else {"prompt": "Hi"}
    body = {"model": model, "max_tokens": 4, **prompt, **fields}
    response = httpx.post(
        f"{server.url}/v1/{endpoint}", json=body, headers=server.headers(), timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    still = server.client().chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, extra_body={"guided_choice": COLORS}
    )
    assert still.choices[0].message.content in COLORS
