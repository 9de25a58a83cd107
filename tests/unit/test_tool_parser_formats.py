"""The `mistral`, `qwen3_coder` and `pythonic` tool-call parsers: published outputs parse to
their calls, malformed and cut outputs stay content (or keep what was generated), and
streaming agrees with `parse` for any split (hermes and llama3_json: test_tool_parsers.py).

The examples follow each format as published: Mistral's function-calling docs and tokenizers
(`[TOOL_CALLS]` array, and `name[ARGS]` since v11), the Qwen3-Coder chat template, and
Llama 3.2's pythonic tool calling (vLLM's tool-calling docs).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings

from services.tokenizer.tool_parsers import ParsedDelta, ToolCall, ToolCallDelta, tool_parser
from shared.protocol import ToolDefinition
from tests.unit.tool_call_streams import check_stream_matches_parse, texts_and_pieces


def calls_of(calls: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def raw_calls(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in calls]


# --- mistral ------------------------------------------------------------------------------

MISTRAL_ARRAY = (
    '[TOOL_CALLS][{"name": "get_current_weather", "arguments": '
    '{"location": "Paris, France", "format": "celsius"}}, '
    '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]'
)
MISTRAL_CALLS = [
    ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
    ("get_time", {"timezone": "Europe/Paris"}),
]
MISTRAL_NAMED = [
    '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}',
    '[TOOL_CALLS]get_time[ARGS]{"timezone": "Europe/Paris"}',
]


@pytest.mark.parametrize(
    "text",
    [
        MISTRAL_ARRAY,
        "".join(MISTRAL_NAMED),
        "\n".join(MISTRAL_NAMED),
        MISTRAL_NAMED[0].replace("[ARGS]", "[CALL_ID]a1B2c3D4e[ARGS]") + MISTRAL_NAMED[1],
        MISTRAL_ARRAY.replace("[TOOL_CALLS][", "[TOOL_CALLS] [\n"),
    ],
)
def test_mistral_parses_both_forms(text: str) -> None:
    content, calls = tool_parser("mistral").parse(text)
    assert content is None
    assert calls_of(calls) == MISTRAL_CALLS


def test_mistral_call_ids_are_nine_letters_and_digits() -> None:
    # Mistral's chat templates check the ids of the calls sent back.
    _, calls = tool_parser("mistral").parse(MISTRAL_ARRAY)
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call.id) for call in calls)
    assert calls[0].id != calls[1].id
    [opened, *_] = tool_parser("mistral").feed(MISTRAL_NAMED[0]).tool_calls
    assert opened.id is not None and re.fullmatch(r"[A-Za-z0-9]{9}", opened.id)


def test_mistral_text_before_the_calls_is_content() -> None:
    content, calls = tool_parser("mistral").parse("Let me look that up.\n\n" + MISTRAL_ARRAY)
    assert content == "Let me look that up."
    assert calls_of(calls) == MISTRAL_CALLS


def test_mistral_array_in_another_key_order_is_read_whole() -> None:
    text = '[TOOL_CALLS][{"arguments": {"a": 1}, "name": "f"}]'
    assert calls_of(tool_parser("mistral").parse(text)[1]) == [("f", {"a": 1})]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "The weather in Paris is 18°C.",
        "[TOOL_CALLS]",
        "[TOOL_CALLS] hello",
        "[TOOL_CALLS][1, 2] and more",
        "[TOOL_CALLS][]",
        '[TOOL_CALLS][{"arguments": {"a": 1}}]',
        "[TOOL_CALLS]get_weather[ARGS] not json",
        "[TOOL_CALLS]get_weather",
    ],
)
def test_mistral_output_without_calls_is_unchanged(text: str) -> None:
    assert tool_parser("mistral").parse(text) == (text, [])


@pytest.mark.parametrize(
    ("text", "arguments"),
    [
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Par', '{"city": "Par'),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par', '{"city": "Par'),
    ],
)
def test_mistral_call_cut_by_max_tokens_keeps_the_text_generated(text: str, arguments: str) -> None:
    assert raw_calls(tool_parser("mistral").parse(text)[1]) == [("get_weather", arguments)]


def test_mistral_stream_sends_arguments_as_they_come() -> None:
    parser = tool_parser("mistral")
    assert parser.feed("Sure. [TOOL_") == ParsedDelta("Sure.")
    assert parser.feed("CALLS]get_time[AR") == ParsedDelta("")
    opened, first = parser.feed('GS]{"timezone": ').tool_calls
    assert (opened.index, opened.name) == (0, "get_time")
    assert first == ToolCallDelta(index=0, arguments='{"timezone": ')
    rest = parser.feed('"Europe/Paris"}')
    assert rest == ParsedDelta("", [ToolCallDelta(index=0, arguments='"Europe/Paris"}')])
    assert parser.finish() == ParsedDelta("")


MISTRAL_PARTS = [
    MISTRAL_ARRAY,
    *MISTRAL_NAMED,
    "Sure. ",
    "\n",
    " ",
    "[TOOL_CALLS]",
    "[TOOL_",
    "[",
    "[ARGS]",
    '{"a": [1, {"b": "]}"}]}',
    "get_weather",
    "[TOOL_CALLS][1, 2]",
    '[TOOL_CALLS][{"arguments": {"a": 1}, "name": "f"}]',
    "Bonjour, ça va ?",
]


@settings(max_examples=300, deadline=None)
@given(texts_and_pieces(MISTRAL_PARTS, ["", "\n", '[TOOL_CALLS]f[ARGS]{"a": "b', "[TOOL_CA"]))
def test_mistral_stream_matches_parse(text_and_pieces: tuple[str, list[str]]) -> None:
    check_stream_matches_parse("mistral", *text_and_pieces)


# --- qwen3_coder --------------------------------------------------------------------------

WEATHER_TOOL = ToolDefinition(
    name="get_weather",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "hours": {"type": "array", "items": {"type": "integer"}},
                "threshold": {"type": ["number", "null"]},
            },
        }
    ),
)
QWEN_CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
    "<parameter=hours>\n[9, 12]\n</parameter>\n<parameter=threshold>\n0.5\n</parameter>\n"
    "</function>\n</tool_call>"
)
QWEN_CODER_ARGUMENTS = {"city": "Paris", "days": 3, "metric": True, "hours": [9, 12]}
SHELL_CALL = (
    "<tool_call>\n<function=run_shell_command>\n<parameter=command>\nmkdir testing\n"
    "</parameter>\n</function>\n</tool_call>"
)


def test_qwen3_coder_converts_values_by_the_tool_schema() -> None:
    text = "I'll check the weather.\n" + QWEN_CODER_CALL + "\n" + SHELL_CALL
    content, calls = tool_parser("qwen3_coder", [WEATHER_TOOL]).parse(text)
    assert content == "I'll check the weather."
    assert calls_of(calls) == [
        ("get_weather", {**QWEN_CODER_ARGUMENTS, "threshold": 0.5}),
        ("run_shell_command", {"command": "mkdir testing"}),
    ]


def test_qwen3_coder_without_tools_keeps_values_as_text() -> None:
    _, [call] = tool_parser("qwen3_coder").parse(QWEN_CODER_CALL)
    assert json.loads(call.arguments)["days"] == "3"


@pytest.mark.parametrize(("value", "expected"), [("null", None), ("twelve", "twelve"), ("7", 7.0)])
def test_qwen3_coder_value_that_does_not_fit_its_type_stays_text(
    value: str, expected: object
) -> None:
    text = QWEN_CODER_CALL.replace("\n0.5\n", f"\n{value}\n").replace("\n3\n", "\nthree\n")
    _, [call] = tool_parser("qwen3_coder", [WEATHER_TOOL]).parse(text)
    arguments = json.loads(call.arguments)
    assert (arguments["days"], arguments["threshold"]) == ("three", expected)


def test_qwen3_coder_keeps_a_multiline_value() -> None:
    code = "def f():\n    return '</function>'\n"
    text = SHELL_CALL.replace("mkdir testing", code)
    _, [call] = tool_parser("qwen3_coder").parse(text)
    assert json.loads(call.arguments) == {"command": code}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "No tools needed.",
        "<tool_call>\nnot a function\n</tool_call>",
        "<tool_call>\n<function=\n</tool_call>",
        "Use <tool_call> and <function=name> tags.",
        "<tool_call>",
        "<tool_call>\n<functi",
    ],
)
def test_qwen3_coder_output_without_calls_is_unchanged(text: str) -> None:
    assert tool_parser("qwen3_coder").parse(text) == (text, [])


def test_qwen3_coder_call_cut_by_max_tokens_keeps_the_parameters_whole() -> None:
    cut = QWEN_CODER_CALL[: QWEN_CODER_CALL.index("true")]
    content, calls = tool_parser("qwen3_coder", [WEATHER_TOOL]).parse(cut)
    assert content is None
    assert raw_calls(calls) == [("get_weather", '{"city": "Paris", "days": 3')]


def test_qwen3_coder_stream_sends_each_parameter_when_it_ends() -> None:
    parser = tool_parser("qwen3_coder", [WEATHER_TOOL])
    assert parser.feed("On it.\n<tool_call>\n<function=get_wea") == ParsedDelta("On it.")
    opened, brace = parser.feed("ther>\n<parameter=city>\nPar").tool_calls
    assert (opened.name, brace.arguments) == ("get_weather", "{")
    assert parser.feed("is\n</parameter>\n") == ParsedDelta(
        "", [ToolCallDelta(index=0, arguments='"city": "Paris"')]
    )
    end = parser.feed("</function>\n</tool_call>")
    assert end == ParsedDelta("", [ToolCallDelta(index=0, arguments="}")])
    assert parser.finish() == ParsedDelta("")


QWEN_CODER_PARTS = [
    QWEN_CODER_CALL,
    SHELL_CALL,
    "I'll check.",
    "\n",
    "  ",
    "<tool_call>",
    "<tool_c",
    "</tool_call>",
    "<function=f>",
    "<parameter=days>\n4\n</parameter>",
    "</function>",
    "ünïcode ☕",
]


@settings(max_examples=300, deadline=None)
@given(texts_and_pieces(QWEN_CODER_PARTS, ["", "\n", QWEN_CODER_CALL[:-40], "<tool_"]))
def test_qwen3_coder_stream_matches_parse(text_and_pieces: tuple[str, list[str]]) -> None:
    check_stream_matches_parse("qwen3_coder", *text_and_pieces, tools=[WEATHER_TOOL])


# --- pythonic -----------------------------------------------------------------------------

# vLLM's tool-calling docs (Llama 3.2 pythonic): two calls in one list.
PYTHONIC_CALLS = (
    '[get_weather(city="San Francisco", metric="celsius"), '
    'get_weather(city="Seattle", metric="celsius")]'
)
PYTHONIC_ARGUMENTS = [
    ("get_weather", {"city": "San Francisco", "metric": "celsius"}),
    ("get_weather", {"city": "Seattle", "metric": "celsius"}),
]
LITERALS_CALL = (
    "[register(name='Zoë', tags=[\"a\", 'b,c'], limits={'max': 3}, ratio=0.5, ok=True, "
    'note=None, pair=(1, 2), doc="""multi\nline, (text)""")]'
)


@pytest.mark.parametrize(
    "text",
    [
        PYTHONIC_CALLS,
        "  " + PYTHONIC_CALLS + "\n",
        "<|python_start|>" + PYTHONIC_CALLS + "<|python_end|>",
        PYTHONIC_CALLS.replace(", get", ",\n  get"),
    ],
)
def test_pythonic_parses_the_published_example(text: str) -> None:
    content, calls = tool_parser("pythonic").parse(text)
    assert content is None
    assert calls_of(calls) == PYTHONIC_ARGUMENTS


def test_pythonic_reads_python_literals() -> None:
    _, [call] = tool_parser("pythonic").parse(LITERALS_CALL)
    assert calls_of([call]) == [
        (
            "register",
            {
                "name": "Zoë",
                "tags": ["a", "b,c"],
                "limits": {"max": 3},
                "ratio": 0.5,
                "ok": True,
                "note": None,
                "pair": [1, 2],
                "doc": "multi\nline, (text)",
            },
        )
    ]


def test_pythonic_never_evaluates_an_argument() -> None:
    _, [call] = tool_parser("pythonic").parse('[f(x=__import__("os").getcwd(), y={1, 2})]')
    assert json.loads(call.arguments) == {"x": '__import__("os").getcwd()', "y": "{1, 2}"}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "The weather in Seattle is 12°C.",
        "Sure: " + PYTHONIC_CALLS,
        "[1, 2, 3]",
        "[Note] see above",
        "[get_weather",
        "<|python_start|>",
    ],
)
def test_pythonic_output_that_does_not_start_with_a_call_is_unchanged(text: str) -> None:
    assert tool_parser("pythonic").parse(text) == (text, [])


def test_pythonic_text_after_the_list_is_content() -> None:
    content, calls = tool_parser("pythonic").parse(PYTHONIC_CALLS + " Anything else?")
    assert content == " Anything else?"
    assert calls_of(calls) == PYTHONIC_ARGUMENTS


def test_pythonic_call_cut_by_max_tokens_keeps_the_arguments_whole() -> None:
    cut = PYTHONIC_CALLS[: PYTHONIC_CALLS.index("Seattle") + 3]
    content, calls = tool_parser("pythonic").parse(cut)
    assert content is None
    assert raw_calls(calls)[1] == ("get_weather", "{")
    assert calls_of(calls[:1]) == PYTHONIC_ARGUMENTS[:1]


def test_pythonic_stream_sends_each_argument_when_it_ends() -> None:
    parser = tool_parser("pythonic")
    assert parser.feed("[get_wea") == ParsedDelta("")
    opened, brace = parser.feed('ther(city="San Fr').tool_calls
    assert (opened.name, brace.arguments) == ("get_weather", "{")
    city = ToolCallDelta(index=0, arguments='"city": "San Francisco"')
    assert parser.feed('ancisco", ') == ParsedDelta("", [city])
    assert parser.feed('metric="celsius")]') == ParsedDelta(
        "", [ToolCallDelta(index=0, arguments=', "metric": "celsius"}')]
    )
    assert parser.finish() == ParsedDelta("")


PYTHONIC_PARTS = [
    PYTHONIC_CALLS,
    LITERALS_CALL,
    "[f(x=1), g()]",
    "[",
    "]",
    ", ",
    "f(",
    "x='a, b)'",
    ")",
    " ",
    "\n",
    "<|python_start|>",
    "<|python_end|>",
    "Anything else?",
]


@settings(max_examples=300, deadline=None)
@given(texts_and_pieces(PYTHONIC_PARTS, ["", "\n", PYTHONIC_CALLS[:-20], "<|python_"]))
def test_pythonic_stream_matches_parse(text_and_pieces: tuple[str, list[str]]) -> None:
    check_stream_matches_parse("pythonic", *text_and_pieces)


EXAMPLES = [
    ("mistral", "Sure.\n" + MISTRAL_ARRAY),
    ("mistral", "".join(MISTRAL_NAMED)),
    ("qwen3_coder", "I'll check.\n" + QWEN_CODER_CALL + "\n" + SHELL_CALL + "\n"),
    ("pythonic", LITERALS_CALL),
    ("pythonic", "<|python_start|>" + PYTHONIC_CALLS + "<|python_end|>"),
]


@pytest.mark.parametrize(("name", "text"), EXAMPLES)
def test_stream_one_character_at_a_time_matches_parse(name: str, text: str) -> None:
    check_stream_matches_parse(name, text, list(text), tools=[WEATHER_TOOL])
