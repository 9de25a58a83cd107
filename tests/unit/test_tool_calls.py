"""ToolCallReader: REQUIRED arrays cut by max_tokens keep their complete calls, and
`parallel_tool_calls: false` yields one call at most in every ToolChoice mode."""

from __future__ import annotations

import json

import pytest

from services.tokenizer.tool_calls import ToolCallReader, complete_elements, required_calls
from shared.protocol import ToolCallDelta, ToolChoice, ToolDefinition

REQUIRED_ARRAY = (
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
    '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}]'
)
HERMES_TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
)


def calls_of(pieces: list[ToolCallDelta]) -> list[tuple[str, object]]:
    """The (name, arguments) calls a client assembles from the pieces."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for piece in pieces:
        if piece.name is not None:
            names[piece.index] = piece.name
        arguments[piece.index] = arguments.get(piece.index, "") + piece.arguments
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)]


def read(reader: ToolCallReader, text: str, piece_len: int = 7) -> tuple[str, list[ToolCallDelta]]:
    content, pieces = "", []
    for start in range(0, len(text), piece_len):
        more_content, more_pieces = reader.feed(text[start : start + piece_len])
        content, pieces = content + more_content, pieces + more_pieces
    more_content, more_pieces = reader.finish()
    return content + more_content, pieces + more_pieces


def test_required_reads_the_whole_array() -> None:
    assert calls_of(required_calls(REQUIRED_ARRAY)) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"timezone": "Europe/Paris"}),
    ]


@pytest.mark.parametrize(
    ("cut_at", "num_calls"),
    [
        (0, 0),
        (1, 0),
        (REQUIRED_ARRAY.index("}}") + 1, 0),  # inside the first call
        (REQUIRED_ARRAY.index("}}") + 2, 1),  # just after it
        (REQUIRED_ARRAY.index(", {") + 1, 1),
        (REQUIRED_ARRAY.index("get_time") + 3, 1),
        (len(REQUIRED_ARRAY) - 1, 2),  # only the `]` is missing
    ],
)
def test_required_array_cut_by_max_tokens_keeps_its_complete_calls(
    cut_at: int, num_calls: int
) -> None:
    pieces = required_calls(REQUIRED_ARRAY[:cut_at])
    assert [name for name, _ in calls_of(pieces)] == ["get_weather", "get_time"][:num_calls]
    assert [p.index for p in pieces if p.name is not None] == list(range(num_calls))


@pytest.mark.parametrize(
    ("text", "elements"),
    [
        ("", []),
        ("{}", []),
        ("[]", []),
        ("[1, 2", [1]),
        ('[1, "tw', [1]),
        ("[1, 2]", [1, 2]),
        ("  [ 1 ,\n 2 ] ", [1, 2]),
    ],
)
def test_complete_elements(text: str, elements: list[object]) -> None:
    assert complete_elements(text) == elements


def test_required_skips_elements_that_are_not_calls() -> None:
    pieces = required_calls('[7, {"parameters": {}}, {"name": "f", "parameters": {"a": 1}}]')
    assert calls_of(pieces) == [("f", {"a": 1})]
    assert pieces[0].index == 0


@pytest.mark.parametrize(
    ("choice", "parser_name", "text"),
    [
        (ToolChoice.REQUIRED, None, REQUIRED_ARRAY),
        (ToolChoice.AUTO, "hermes", HERMES_TWO_CALLS),
        (ToolChoice.FUNCTION, None, '{"city": "Paris"}'),
    ],
)
@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_false_yields_exactly_one_call(
    choice: ToolChoice, parser_name: str | None, text: str, parallel: bool
) -> None:
    reader = ToolCallReader(choice, "get_weather", parser_name, parallel)
    content, pieces = read(reader, text)
    calls = calls_of(pieces)
    assert content == ""
    assert calls[0] == ("get_weather", {"city": "Paris"})
    assert len(calls) == (1 if choice is ToolChoice.FUNCTION or not parallel else 2)


def test_auto_passes_the_tools_to_the_parser() -> None:
    tool = ToolDefinition(
        name="f", parameters='{"type": "object", "properties": {"n": {"type": "integer"}}}'
    )
    reader = ToolCallReader(ToolChoice.AUTO, None, "qwen3_coder", tools=[tool])
    text = "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"
    assert calls_of(read(reader, text)[1]) == [("f", {"n": 3})]


def test_required_array_cut_anywhere_keeps_the_calls_ended_before_the_cut() -> None:
    ends = [REQUIRED_ARRAY.index("}}") + 2, REQUIRED_ARRAY.rindex("}}") + 2]
    for cut_at in range(len(REQUIRED_ARRAY) + 1):
        num_calls = sum(end <= cut_at for end in ends)
        names = [name for name, _ in calls_of(required_calls(REQUIRED_ARRAY[:cut_at]))]
        assert names == ["get_weather", "get_time"][:num_calls], cut_at
