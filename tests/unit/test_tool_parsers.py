"""Tool-call parsers: published outputs parse to their calls, and streaming agrees with `parse`.

The examples follow the formats as their model cards show them: Qwen2.5's function-calling
guide for `hermes`, Llama 3.1's JSON-based tool calling for `llama3_json`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings

from services.tokenizer.tool_parsers import (
    TOOL_PARSERS,
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    tool_parser,
)
from tests.unit.tool_call_streams import check_stream_matches_parse, texts_and_pieces

CALL_ID = re.compile(r"call_[0-9a-f]{24}")

# Qwen2.5's function-calling guide: two calls in one turn.
QWEN_ARGUMENTS = [
    ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
    ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}),
]
QWEN_BLOCKS = [
    '<tool_call>\n{"name": "get_current_temperature", "arguments": '
    '{"location": "San Francisco, CA, USA"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_temperature_date", "arguments": '
    '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>',
]
QWEN_TWO_CALLS = "\n".join(QWEN_BLOCKS)
QWEN3_THINKING = "<think>\nThe user wants today's temperature and tomorrow's.\n</think>"
NON_ASCII_BLOCK = (
    '<tool_call>\n{"name": "天気", "arguments": {"city": "東京", "note": "café ☕"}}\n</tool_call>'
)
MALFORMED_BLOCK = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": \n</tool_call>'
)
NAMELESS_BLOCK = '<tool_call>\n{"arguments": {"location": "Paris"}}\n</tool_call>'
UNTERMINATED_BLOCK = '<tool_call>\n{"name": "get_temperature_date", "arguments": {"loca'

# Llama 3.1's model card: a JSON-based call, its built-in-tool (python) form, and a second call.
LLAMA_CALL = (
    '{"name": "get_current_conditions", "parameters": '
    '{"location": "San Francisco, CA", "unit": "Fahrenheit"}}'
)
LLAMA_ARGUMENTS = {"location": "San Francisco, CA", "unit": "Fahrenheit"}
LLAMA_SECOND_CALL = '{"name": "get_current_time", "arguments": {"timezone": "America/Los_Angeles"}}'
LLAMA_BUILTIN = '<|python_tag|>brave_search.call(query="current weather in Menlo Park, California")'


def calls_of(calls: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def check_ids(calls: list[ToolCall]) -> None:
    assert all(CALL_ID.fullmatch(call.id) for call in calls)
    assert len({call.id for call in calls}) == len(calls)


# --- hermes -------------------------------------------------------------------------------


def test_hermes_parses_qwen_example() -> None:
    content, calls = tool_parser("hermes").parse(QWEN_TWO_CALLS)
    assert content is None
    assert calls_of(calls) == QWEN_ARGUMENTS
    check_ids(calls)


@pytest.mark.parametrize(
    "before", ["Let me check the temperatures.", QWEN3_THINKING, "  Sure!", "你好，我来查一下。"]
)
@pytest.mark.parametrize("gap", ["", "\n", "\n\n", " \t\n"])
def test_hermes_content_is_the_text_before_the_calls(before: str, gap: str) -> None:
    content, calls = tool_parser("hermes").parse(before + gap + QWEN_TWO_CALLS + "\n")
    assert content == before.rstrip()
    assert calls_of(calls) == QWEN_ARGUMENTS


def test_hermes_whitespace_before_the_calls_is_no_content() -> None:
    assert tool_parser("hermes").parse("\n\n" + QWEN_BLOCKS[0] + "\n")[0] is None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "  \n",
        "The temperature in San Francisco is 26.1°C.\n",
        "Wrap calls in <tool_call></tool_call> tags.",
        NAMELESS_BLOCK,
        '<tool_call>\n{"arguments": {"location": "Paris"}',
        '<tool_call>\n["get_current_temperature"]\n</tool_call>',
        '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
        "<tool_call>" + "[" * 100_000 + "</tool_call>",
    ],
)
def test_hermes_output_without_calls_is_unchanged(text: str) -> None:
    assert tool_parser("hermes").parse(text) == (text, [])


def test_hermes_call_with_broken_arguments_keeps_the_text_generated() -> None:
    # Its name was sent while streaming, so it stays a call: the arguments end at the marker.
    text = "Checking.\n" + MALFORMED_BLOCK + "\n" + QWEN_BLOCKS[1]
    content, calls = tool_parser("hermes").parse(text)
    assert content == "Checking."
    assert [(c.name, c.arguments) for c in calls[:1]] == [
        ("get_current_temperature", '{"location": \n')
    ]
    assert calls_of(calls[1:]) == QWEN_ARGUMENTS[1:]


def test_hermes_call_cut_by_max_tokens_keeps_the_text_generated() -> None:
    content, calls = tool_parser("hermes").parse(QWEN_BLOCKS[0] + "\n" + UNTERMINATED_BLOCK)
    assert content is None
    assert calls_of(calls[:1]) == QWEN_ARGUMENTS[:1]
    assert (calls[1].name, calls[1].arguments) == ("get_temperature_date", '{"loca')


def test_hermes_block_without_its_end_tag_ends_at_the_next_block() -> None:
    text = QWEN_BLOCKS[0].removesuffix("</tool_call>") + QWEN_BLOCKS[1]
    assert calls_of(tool_parser("hermes").parse(text)[1]) == QWEN_ARGUMENTS


def test_hermes_block_in_another_key_order_is_read_whole() -> None:
    block = '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>'
    assert calls_of(tool_parser("hermes").parse(block)[1]) == [("f", {"a": 1})]


def test_hermes_block_without_a_name_that_never_ends_stays_content() -> None:
    text = "Hi " + '<tool_call>\n{"arguments": {"a": 1}'
    assert tool_parser("hermes").parse(text) == (text, [])


def test_hermes_text_after_the_calls_is_content() -> None:
    content, _ = tool_parser("hermes").parse("Sure.\n" + QWEN_BLOCKS[0] + "\nDone.\n")
    assert content == "Sure.\nDone.\n"


def test_hermes_missing_arguments_are_empty() -> None:
    _, calls = tool_parser("hermes").parse('<tool_call>\n{"name": "get_time"}\n</tool_call>')
    assert calls_of(calls) == [("get_time", {})]


def test_hermes_keeps_non_ascii_arguments_as_text() -> None:
    _, [call] = tool_parser("hermes").parse(NON_ASCII_BLOCK)
    assert call.name == "天気"
    assert call.arguments == '{"city": "東京", "note": "café ☕"}'


# --- llama3_json --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        LLAMA_CALL,
        "<|python_tag|>" + LLAMA_CALL,
        "\n  " + LLAMA_CALL + "\n",
        LLAMA_CALL.replace('"parameters"', '"arguments"'),
    ],
)
def test_llama3_parses_one_call(text: str) -> None:
    content, calls = tool_parser("llama3_json").parse(text)
    assert content is None
    assert calls_of(calls) == [("get_current_conditions", LLAMA_ARGUMENTS)]
    check_ids(calls)


@pytest.mark.parametrize("prefix", ["", "<|python_tag|>"])
@pytest.mark.parametrize("separator", [";", "; ", " ;\n"])
def test_llama3_parses_calls_separated_by_semicolons(prefix: str, separator: str) -> None:
    text = prefix + LLAMA_CALL + separator + LLAMA_SECOND_CALL
    content, calls = tool_parser("llama3_json").parse(text)
    assert content is None
    assert calls_of(calls) == [
        ("get_current_conditions", LLAMA_ARGUMENTS),
        ("get_current_time", {"timezone": "America/Los_Angeles"}),
    ]
    check_ids(calls)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "The weather in San Francisco is 72°F and sunny.",
        "Here it is: " + LLAMA_CALL,
        LLAMA_BUILTIN,
        "<|python_tag|>",
        '{"answer": 42}',
        '{"name": "get_current_conditions"}',
        '{"name": "get_current_conditions", "parameters": "San Francisco"}',
        "[" + LLAMA_CALL + "]",
    ],
)
def test_llama3_output_that_is_not_all_calls_is_unchanged(text: str) -> None:
    assert tool_parser("llama3_json").parse(text) == (text, [])


@pytest.mark.parametrize(
    ("tail", "content"),
    [
        (" Let me know if you need more.", " Let me know if you need more."),
        (";", None),
        ("; {broken", "; {broken"),
        (" \n", None),
    ],
)
def test_llama3_text_after_the_calls(tail: str, content: str | None) -> None:
    parsed, calls = tool_parser("llama3_json").parse(LLAMA_CALL + tail)
    assert parsed == content
    assert calls_of(calls) == [("get_current_conditions", LLAMA_ARGUMENTS)]


def test_llama3_call_cut_by_max_tokens_keeps_the_text_generated() -> None:
    content, [call] = tool_parser("llama3_json").parse(LLAMA_CALL[:-5])
    assert content is None
    assert (call.name, call.arguments) == (
        "get_current_conditions",
        LLAMA_CALL[LLAMA_CALL.index("{", 1) : -5],
    )


# --- the registry -------------------------------------------------------------------------


def test_registry_names_match_vllm() -> None:
    assert sorted(TOOL_PARSERS) == [
        "granite", "hermes", "llama3_json", "mistral", "openai", "phi4_mini_json", "pythonic",
        "qwen3_coder",
    ]  # fmt: skip


def test_tool_parser_returns_a_fresh_parser() -> None:
    first, second = tool_parser("hermes"), tool_parser("hermes")
    assert first is not second
    assert isinstance(first, ToolParser)


def test_unknown_tool_parser_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown tool call parser 'jamba'; choose from granite"):
        tool_parser("jamba")


# --- streaming, step by step --------------------------------------------------------------


def test_hermes_stream_holds_a_split_marker() -> None:
    parser = tool_parser("hermes")
    assert parser.feed("Let me check.<tool_") == ParsedDelta("Let me check.")
    delta = parser.feed(QWEN_BLOCKS[0][len("<tool_") : -3])
    assert delta.content == ""
    first, rest = delta.tool_calls
    assert (first.index, first.name, first.arguments) == (0, "get_current_temperature", "")
    assert first.id is not None and CALL_ID.fullmatch(first.id)
    assert rest == ToolCallDelta(index=0, arguments='{"location": "San Francisco, CA, USA"}')
    assert parser.feed(QWEN_BLOCKS[0][-3:]) == ParsedDelta("")
    assert parser.finish() == ParsedDelta("")


def test_hermes_stream_releases_a_false_marker() -> None:
    parser = tool_parser("hermes")
    assert parser.feed("Use a <tool_c") == ParsedDelta("Use a")
    assert parser.feed("hain>.") == ParsedDelta(" <tool_chain>.")
    assert parser.finish() == ParsedDelta("")


def test_hermes_stream_numbers_the_calls() -> None:
    parser = tool_parser("hermes")
    assert parser.feed("Sure.\n\n") == ParsedDelta("Sure.")  # the whitespace waits
    deltas = [parser.feed(block + "\n") for block in QWEN_BLOCKS]
    assert [d.index for delta in deltas for d in delta.tool_calls] == [0, 0, 1, 1]
    assert all(delta.content == "" for delta in deltas)
    assert parser.finish() == ParsedDelta("")


def test_hermes_stream_sends_arguments_as_they_come() -> None:
    parser = tool_parser("hermes")
    assert parser.feed('Hi <tool_call>\n{"name": "get_temperature_date", "argu') == ParsedDelta(
        "Hi"
    )
    opened, first = parser.feed('ments": {"loca').tool_calls
    assert (opened.index, opened.name, opened.arguments) == (0, "get_temperature_date", "")
    assert first == ToolCallDelta(index=0, arguments='{"loca')
    more = ParsedDelta("", [ToolCallDelta(index=0, arguments='tion": "Paris"}')])
    assert parser.feed('tion": "Paris"}') == more
    assert parser.feed("}\n</tool_call>") == ParsedDelta("")
    assert parser.finish() == ParsedDelta("")


def test_llama3_stream_sends_plain_text_at_once() -> None:
    parser = tool_parser("llama3_json")
    assert parser.feed("\n") == ParsedDelta("")
    assert parser.feed("The") == ParsedDelta("\nThe")
    assert parser.feed(" weather {") == ParsedDelta(" weather {")
    assert parser.finish() == ParsedDelta("")


def test_llama3_stream_sends_arguments_as_they_come() -> None:
    parser = tool_parser("llama3_json")
    assert parser.feed("<|python") == ParsedDelta("")
    head, rest = LLAMA_CALL[:60], LLAMA_CALL[60:]
    delta = parser.feed("_tag|>" + head)
    assert delta.content == ""
    assert [(d.index, d.name, d.arguments) for d in delta.tool_calls] == [
        (0, "get_current_conditions", ""),
        (0, None, head[head.index("{", 1) :]),
    ]
    assert parser.feed(rest).tool_calls == [ToolCallDelta(index=0, arguments=rest[:-1])]
    assert parser.finish() == ParsedDelta("")


# --- streaming agrees with parse, for any split ---------------------------------------------


HERMES_PARTS = [
    "Let me check.",
    QWEN3_THINKING,
    "你好，世界！",
    "café ☕ ",
    " ",
    "\n",
    "\n\n",
    *QWEN_BLOCKS,
    NON_ASCII_BLOCK,
    MALFORMED_BLOCK,
    NAMELESS_BLOCK,
    "<",
    "<tool_c",
    "<tool_call>",
    "</tool_call>",
    "Use <tool_call> tags.",
    '<tool_call>\n{"name": "f", "arguments": {"a": "</tool_call>", "b": [1, {"c": "}"}]}}\n',
    '<tool_call>\n{"name": "g", "argu',
    '{"x": "\\"}',
    "}\n</tool_call>",
    '<tool_call>{"arguments": {}, "name": "h"}</tool_call>',
]
LLAMA_PARTS = [
    LLAMA_CALL,
    LLAMA_SECOND_CALL,
    "<|python_tag|>",
    "<|python",
    ";",
    "; ",
    " ",
    "\n",
    "{",
    '{"answer": 42}',
    '{"name": "天気", "parameters": {"city": "東京"}}',
    "The weather is sunny. ",
    LLAMA_BUILTIN,
]


@settings(max_examples=200, deadline=None)
@given(texts_and_pieces(HERMES_PARTS, ["", "\n", UNTERMINATED_BLOCK, "<tool_"]))
def test_hermes_stream_matches_parse(text_and_pieces: tuple[str, list[str]]) -> None:
    check_stream_matches_parse("hermes", *text_and_pieces)


@settings(max_examples=200, deadline=None)
@given(texts_and_pieces(LLAMA_PARTS, ["", "\n", LLAMA_CALL[:-5]]))
def test_llama3_stream_matches_parse(text_and_pieces: tuple[str, list[str]]) -> None:
    check_stream_matches_parse("llama3_json", *text_and_pieces)


# gpt-oss's calls as the openai_gptoss reader hands them on (services/tokenizer/harmony.py)
OPENAI_CALL = '<|start|>functions.get_weather<|message|>{"city": "Paris"}<|call|>'


def test_openai_reads_harmony_calls_and_leaves_the_rest() -> None:
    content, calls = tool_parser("openai").parse("Checking." + OPENAI_CALL + OPENAI_CALL)
    assert content == "Checking."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')] * 2
    cut, [call] = tool_parser("openai").parse(OPENAI_CALL[:-9])  # max_tokens in the arguments
    assert cut is None and (call.name, call.arguments) == ("get_weather", '{"city": "Paris"')
    assert tool_parser("openai").parse("No tools: a <|start| b.") == ("No tools: a <|start| b.", [])


EXAMPLES = [
    ("hermes", QWEN3_THINKING + "\n\n" + QWEN_TWO_CALLS + "\n"),
    ("hermes", "Checking.\n" + MALFORMED_BLOCK + "\n" + NON_ASCII_BLOCK + "\nDone. "),
    ("hermes", QWEN_BLOCKS[0] + "\n" + UNTERMINATED_BLOCK),
    ("hermes", "No tools needed: 26.1°C, café ☕.\n"),
    ("llama3_json", "<|python_tag|>" + LLAMA_CALL + "; " + LLAMA_SECOND_CALL),
    ("llama3_json", LLAMA_BUILTIN),
    ("llama3_json", "  The weather is sunny.\n"),
    ("openai", "Let me look." + OPENAI_CALL + OPENAI_CALL[:-12]),
]


@pytest.mark.parametrize(("name", "text"), EXAMPLES)
def test_stream_one_character_at_a_time_matches_parse(name: str, text: str) -> None:
    check_stream_matches_parse(name, text, list(text))
