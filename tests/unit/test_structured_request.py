"""What a request body asks of its output's shape: the frontend's reading of OpenAI's and vLLM's
structured-output and tool fields, and the tokenizer worker's reading of tool calls from the
output text as it streams."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest

from services.frontend.api.endpoints import read_chat
from services.frontend.api.openai_types import ChatCompletionRequest, CompletionRequest, decode_body
from services.frontend.api.structured import ToolRequest, structured_output, tool_request
from services.tokenizer.worker import TokenizerWorker
from shared.protocol import (
    ChatMessage,
    FinishReason,
    GenerateRequest,
    ParameterError,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
    TextDelta,
    ToolChoice,
    ToolDefinition,
)

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def chat(**fields: Any) -> ChatCompletionRequest:
    body = json.dumps({"messages": MESSAGES, **fields}).encode()
    return decode_body(body, ChatCompletionRequest)


def completion(**fields: Any) -> CompletionRequest:
    return decode_body(json.dumps({"prompt": "hi", **fields}).encode(), CompletionRequest)


def refusal(read: Any, body: Any) -> ParameterError:
    with pytest.raises(ParameterError) as error:
        read(body)
    return error.value


# ------------------------------------------------------------------ structured output fields

FIELDS = [
    (
        {"response_format": {"type": "json_object"}},
        StructuredOutput(json_object=True, source="response_format"),
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": SCHEMA},
            }
        },
        StructuredOutput(json=json.dumps(SCHEMA), source="response_format"),
    ),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(json=json.dumps(SCHEMA))),
    (
        {"structured_outputs": {"json": '{"type": "integer"}'}},
        StructuredOutput(json='{"type": "integer"}'),
    ),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput(json_object=True)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutput(choice=["a", "b"])),
    ({"structured_outputs": {"grammar": "start: /x/"}}, StructuredOutput(grammar="start: /x/")),
    (
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        StructuredOutput(json=json.dumps(SCHEMA), disable_any_whitespace=True),
    ),
    ({"guided_json": SCHEMA}, StructuredOutput(json=json.dumps(SCHEMA), source="guided_json")),
    (
        {"guided_json": '{"type": "string"}'},
        StructuredOutput(json='{"type": "string"}', source="guided_json"),
    ),
    ({"guided_regex": "[0-9]+"}, StructuredOutput(regex="[0-9]+", source="guided_regex")),
    (
        {"guided_choice": ["yes", "no"]},
        StructuredOutput(choice=["yes", "no"], source="guided_choice"),
    ),
    (
        {"guided_grammar": "root ::= [a-z]"},
        StructuredOutput(grammar="root ::= [a-z]", source="guided_grammar"),
    ),
]


@pytest.mark.parametrize("fields, expected", FIELDS)
def test_each_field_is_one_structured_output_named_by_its_source(
    fields: dict[str, Any], expected: StructuredOutput
) -> None:
    assert structured_output(chat(**fields)) == expected
    assert structured_output(completion(**fields)) == expected


def test_no_field_or_a_text_format_asks_for_nothing() -> None:
    assert structured_output(chat()) is None
    assert structured_output(chat(response_format={"type": "text"})) is None


@pytest.mark.parametrize(
    "fields, second",
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "x"}, "guided_regex"),
        ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "x"}, "guided_grammar": "start: /x/"}, "guided_grammar"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "x"}},
            "structured_outputs",
        ),
    ],
)
def test_two_structured_outputs_are_refused_naming_the_second(
    fields: dict[str, Any], second: str
) -> None:
    error = refusal(structured_output, chat(**fields))
    assert error.param == second and "one structured output" in str(error)


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}},
            "response_format",
            "json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "type must be"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        (
            {"structured_outputs": {"regex": "x", "choice": ["x"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"guided_choice": []}, "guided_choice", "choice is empty"),
    ],
)
def test_malformed_structured_outputs_are_refused(
    fields: dict[str, Any], param: str, message: str
) -> None:
    error = refusal(structured_output, chat(**fields))
    assert error.param == param and message in str(error)


def test_unknown_structured_outputs_keys_are_refused_when_decoding() -> None:
    with pytest.raises(ParameterError) as error:
        chat(structured_outputs={"regexp": "x"})
    assert error.value.param == "structured_outputs"


# ------------------------------------------------------------------ tools and tool_choice


def tool(name: str, parameters: dict[str, Any] | None = SCHEMA) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": f"{name}, for tests"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


TOOLS = [tool("get_weather"), tool("get_time", None)]
NO_PARAMETERS = {"type": "object", "properties": {}}


def test_tools_are_definitions_for_the_template() -> None:
    request = tool_request(chat(tools=TOOLS, tool_choice="none"))
    assert request == ToolRequest(
        tools=[
            ToolDefinition(
                name="get_weather",
                description="get_weather, for tests",
                parameters=json.dumps(SCHEMA),
            ),
            ToolDefinition(
                name="get_time",
                description="get_time, for tests",
                parameters=json.dumps(NO_PARAMETERS),
            ),
        ]
    )
    assert request.choice is None and request.structured_output is None  # text only


def test_without_tools_there_is_nothing_to_read() -> None:
    assert tool_request(chat()) == ToolRequest()
    assert tool_request(chat(tool_choice="none")) == ToolRequest()


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_is_the_default_with_tools(choice: str | None) -> None:
    fields: dict[str, Any] = {"tools": TOOLS, "parallel_tool_calls": False}
    if choice is not None:
        fields["tool_choice"] = choice
    request = tool_request(chat(**fields))
    assert (request.choice, request.parallel, request.structured_output) == (
        ToolChoice.AUTO,
        False,
        None,
    )


def required_schema(parallel: bool) -> dict[str, Any]:
    request = tool_request(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel))
    assert request.choice is ToolChoice.REQUIRED and request.name is None
    spec = request.structured_output
    assert spec is not None and spec.source == "tools"
    return json.loads(spec.json or "")


WEATHER_CALL = {"name": "get_weather", "parameters": {"city": "Paris"}}
TIME_CALL = {"name": "get_time", "parameters": {}}


def test_required_asks_for_an_array_of_calls_to_the_tools() -> None:
    schema = required_schema(parallel=True)
    jsonschema.validate([WEATHER_CALL], schema)
    jsonschema.validate([WEATHER_CALL, TIME_CALL], schema)
    for wrong in (
        [],  # at least one call
        [{"name": "get_wether", "parameters": {"city": "Paris"}}],  # no such tool
        [{"name": "get_weather", "parameters": {}}],  # its parameters' schema
        [{"name": "get_weather", "parameters": {"city": "Paris"}, "extra": 1}],
        [{"name": "get_weather"}],
        WEATHER_CALL,  # not an array
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_required_without_parallel_calls_allows_one() -> None:
    schema = required_schema(parallel=False)
    assert schema["maxItems"] == 1
    jsonschema.validate([TIME_CALL], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([WEATHER_CALL, TIME_CALL], schema)


def test_a_named_function_asks_for_its_arguments() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = tool_request(chat(tools=TOOLS, tool_choice=named))
    assert (request.choice, request.name) == (ToolChoice.FUNCTION, "get_weather")
    assert request.structured_output == StructuredOutput(json=json.dumps(SCHEMA), source="tools")
    no_parameters = {"type": "function", "function": {"name": "get_time"}}
    spec = tool_request(chat(tools=TOOLS, tool_choice=no_parameters)).structured_output
    assert spec is not None and json.loads(spec.json or "") == NO_PARAMETERS


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_rain"}}, "tools": TOOLS},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools"),
    ],
)
def test_tool_choices_the_tools_do_not_fit_are_refused(fields: dict[str, Any], param: str) -> None:
    assert refusal(tool_request, chat(**fields)).param == param


FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "integer"}}}
FORCED_CHOICES = ["required", {"type": "function", "function": {"name": "get_weather"}}]


@pytest.mark.parametrize("choice", FORCED_CHOICES, ids=["required", "named"])
def test_a_forced_call_takes_the_place_of_response_format(choice: Any) -> None:
    """A forced call is the whole reply: response_format, a text reply's shape, gives way (as
    OpenAI's and vLLM's do; the Agents SDK sends both for an agent with an output_type)."""
    body = chat(tools=TOOLS, tool_choice=choice, response_format=FORMAT)
    spec = read_chat(body).params.structured_output
    assert spec == tool_request(body).structured_output and spec is not None
    assert spec.source == "tools"
    text_reply = read_chat(chat(tools=TOOLS, tool_choice="none", response_format=FORMAT))
    assert text_reply.params.structured_output == structured_output(chat(response_format=FORMAT))


@pytest.mark.parametrize("choice", FORCED_CHOICES, ids=["required", "named"])
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"structured_outputs": {"regex": "x"}}, "structured_outputs"),
        ({"guided_json": SCHEMA}, "guided_json"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),  # malformed
    ],
)
def test_vllm_fields_or_a_malformed_format_beside_a_forced_call_are_refused(
    choice: Any, fields: dict[str, Any], param: str
) -> None:
    error = refusal(read_chat, chat(tools=TOOLS, tool_choice=choice, **fields))
    assert error.param == param


# ------------------------------------------------------------------ reading calls from the output


@pytest.fixture(scope="module")
def worker(smollm2_tokenizer) -> TokenizerWorker:
    """One worker for the module, as one serves many requests (its grammar checker is made
    once); each test uses its own request ids."""
    return TokenizerWorker(copy.copy(smollm2_tokenizer), tool_call_parser="hermes")


def admit(worker: TokenizerWorker, request_id: str, body: ChatCompletionRequest) -> None:
    """Admit a chat as the frontend sends it: its tools, and their grammar if any."""
    tools = tool_request(body)
    params = SamplingParams(structured_output=tools.structured_output, max_tokens=200)
    worker.admit(
        GenerateRequest(
            request_id=request_id,
            sampling_params=params,
            messages=[ChatMessage("user", MESSAGES[0]["content"])],
            tools=tools.tools,
            tool_choice=tools.choice,
            tool_name=tools.name,
            parallel_tool_calls=tools.parallel,
        )
    )


def stream(
    worker: TokenizerWorker,
    request_id: str,
    text: str,
    num_pieces: int = 4,
    finish: FinishReason = FinishReason.STOP,
) -> list[TextDelta]:
    """The deltas for `text`'s tokens, arriving in `num_pieces` outputs, the last finishing."""
    token_ids = worker.tokenizer.encode(text, add_special_tokens=False)
    size = -(-len(token_ids) // num_pieces)
    pieces = [token_ids[i : i + size] for i in range(0, len(token_ids), size)]
    outputs = [RequestOutput(request_id=request_id, new_token_ids=piece) for piece in pieces]
    outputs[-1].finish_reason = finish
    deltas, _ = worker.on_outputs(outputs)
    assert len(deltas) == len(pieces) and deltas[-1].finish_reason is finish
    return deltas


def calls_of(deltas: list[TextDelta]) -> list[dict[str, Any]]:
    """The calls the pieces add up to, as a client assembles them."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            call = calls.setdefault(
                piece.index, {"id": piece.id, "name": piece.name, "arguments": ""}
            )
            call["arguments"] += piece.arguments
    return [
        {"name": calls[i]["name"], "arguments": json.loads(calls[i]["arguments"])}
        for i in sorted(calls)
    ]


def text_of(deltas: list[TextDelta]) -> str:
    return "".join(delta.text for delta in deltas)


HERMES_OUTPUT = (
    "Let me look that up.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_auto_reads_the_parsers_tool_call_blocks(worker: TokenizerWorker) -> None:
    admit(worker, "auto", chat(tools=TOOLS))
    deltas = stream(worker, "auto", HERMES_OUTPUT, num_pieces=7)
    assert text_of(deltas) == "Let me look that up."
    assert calls_of(deltas) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_time", "arguments": {}},
    ]
    ids = [piece.id for delta in deltas for piece in delta.tool_calls if piece.id is not None]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_auto_without_parallel_calls_keeps_the_first(worker: TokenizerWorker) -> None:
    admit(worker, "auto-one", chat(tools=TOOLS, parallel_tool_calls=False))
    deltas = stream(worker, "auto-one", HERMES_OUTPUT)
    assert calls_of(deltas) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]


def test_auto_text_without_calls_is_content(worker: TokenizerWorker) -> None:
    admit(worker, "auto-text", chat(tools=TOOLS))
    deltas = stream(worker, "auto-text", "It is sunny in Paris today.")
    assert text_of(deltas) == "It is sunny in Paris today." and calls_of(deltas) == []


def test_required_reads_the_array_at_the_end(worker: TokenizerWorker) -> None:
    admit(worker, "required", chat(tools=TOOLS, tool_choice="required"))
    deltas = stream(worker, "required", json.dumps([WEATHER_CALL, TIME_CALL]))
    assert all(not delta.tool_calls for delta in deltas[:-1])  # a partial array names no call
    assert text_of(deltas) == ""
    assert calls_of(deltas) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_time", "arguments": {}},
    ]


def test_a_required_array_cut_short_makes_no_call(worker: TokenizerWorker) -> None:
    admit(worker, "required-cut", chat(tools=TOOLS, tool_choice="required"))
    text = json.dumps([WEATHER_CALL])[:-5]
    deltas = stream(worker, "required-cut", text, finish=FinishReason.LENGTH)
    assert calls_of(deltas) == [] and text_of(deltas) == ""


def test_a_named_function_streams_its_arguments(worker: TokenizerWorker) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    admit(worker, "named", chat(tools=TOOLS, tool_choice=named))
    arguments = '{"city": "Paris", "unit": "celsius"}'
    deltas = stream(worker, "named", arguments)
    first = deltas[0].tool_calls[0]
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "")
    assert first.id is not None and first.id.startswith("call_")
    pieces = [p.arguments for d in deltas for p in d.tool_calls if p.arguments]
    assert len(pieces) > 1 and "".join(pieces) == arguments  # streamed, not held
    assert text_of(deltas) == ""


def test_a_tools_invalid_schema_is_refused_at_admission_naming_tools(
    worker: TokenizerWorker,
) -> None:
    broken = [tool("get_weather", {"type": "strin"})]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = chat(tools=broken, tool_choice=choice)
        error = refusal(lambda body: admit(worker, "broken", body), body)
        assert error.param == "tools" and "strin" in str(error)
    assert "broken" not in worker.live


def test_auto_needs_a_tool_call_parser(smollm2_tokenizer) -> None:
    worker = TokenizerWorker(copy.copy(smollm2_tokenizer))
    error = refusal(lambda body: admit(worker, "auto-unparsed", body), chat(tools=TOOLS))
    assert error.param == "tool_choice" and "--tool-call-parser" in str(error)
    assert not worker.live
    admit(worker, "none", chat(tools=TOOLS, tool_choice="none"))  # text only: no parser needed
