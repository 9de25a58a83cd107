"""The `phi4_mini_json` and `granite` tool-call parsers: a JSON array of calls after a marker
(`functools`; `<|tool_call|>` or `<tool_call>`). Published-shaped outputs parse to their calls,
text around them is content, malformed or unmarked arrays stay content, a call cut by max_tokens
keeps what was generated, and streaming agrees with `parse` for any split.

The examples follow each format as its model's chat template and vLLM's parser of the same name
read it: Phi-4-mini's `functools[...]` and Granite 3's `<|tool_call|>[...]`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings

from services.tokenizer.tool_parsers import ToolCall, tool_parser
from tests.unit.tool_call_streams import check_stream_matches_parse, texts_and_pieces

ARRAY = (
    '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
    '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}]'
)
CALLS = [
    ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ("get_time", {"timezone": "Europe/Paris"}),
]
MARKERS = {"phi4_mini_json": ["functools"], "granite": ["<|tool_call|>", "<tool_call>"]}
FORMATS = [(name, marker) for name, markers in MARKERS.items() for marker in markers]


def calls_of(calls: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize(("name", "marker"), FORMATS)
@pytest.mark.parametrize("gap", ["", " ", "\n"])
def test_the_array_after_the_marker_is_the_calls(name: str, marker: str, gap: str) -> None:
    content, calls = tool_parser(name).parse(marker + gap + ARRAY)
    assert content is None and calls_of(calls) == CALLS


@pytest.mark.parametrize(("name", "marker"), FORMATS)
def test_text_around_the_calls_is_content(name: str, marker: str) -> None:
    content, calls = tool_parser(name).parse(f"Let me look.\n{marker}{ARRAY}\nDone.")
    assert content == "Let me look.\nDone." and calls_of(calls) == CALLS


@pytest.mark.parametrize("name", sorted(MARKERS))
@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is mild.",
        ARRAY,  # no marker: an array in the answer
        "functools are useful; <tool_call> too.",  # markers not followed by an array
        '{"name": "get_weather", "arguments": {}}',
    ],
)
def test_outputs_without_marked_calls_are_content(name: str, text: str) -> None:
    assert tool_parser(name).parse(text) == (text, [])


@pytest.mark.parametrize(("name", "marker"), FORMATS)
def test_an_array_of_other_objects_stays_content(name: str, marker: str) -> None:
    text = f'{marker}[{{"city": "Paris"}}, 3]'
    assert tool_parser(name).parse(text) == (text, [])


@pytest.mark.parametrize(("name", "marker"), FORMATS)
def test_a_call_cut_by_max_tokens_keeps_the_text_generated(name: str, marker: str) -> None:
    text = marker + '[{"name": "get_weather", "arguments": {"city": "Par'
    content, calls = tool_parser(name).parse(text)
    assert content is None
    assert [(call.name, call.arguments) for call in calls] == [("get_weather", '{"city": "Par')]


PARTS = [
    "functools",
    "<|tool_call|>",
    "<tool_call>",
    ARRAY,
    ARRAY[:-30],
    "Sure. ",
    "\n",
    " ",
    "<|tool_",
    "functo",
    "[",
    '{"a": [1, {"b": "]}"}]}',
]


@settings(max_examples=300, deadline=None)
@given(texts_and_pieces(PARTS, ["", "\n", "functools" + ARRAY[:40], "<tool_"]))
def test_phi4_mini_json_stream_matches_parse(text_and_pieces: tuple[str, list[str]]) -> None:
    check_stream_matches_parse("phi4_mini_json", *text_and_pieces)


@settings(max_examples=300, deadline=None)
@given(texts_and_pieces(PARTS, ["", "\n", "<|tool_call|>" + ARRAY[:40], "<tool_"]))
def test_granite_stream_matches_parse(text_and_pieces: tuple[str, list[str]]) -> None:
    check_stream_matches_parse("granite", *text_and_pieces)
