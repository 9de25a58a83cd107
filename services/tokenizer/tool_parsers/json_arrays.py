"""Calls as a JSON array after a marker: `[{"name": ..., "arguments": {...}}, ...]`.

- `phi4_mini_json` (Phi-4-mini): `functools[{"name": "get_weather", "arguments": {...}}]`;
- `granite` (Granite 3.x): `<|tool_call|>[{"name": "get_weather", "arguments": {...}}]`, or
  `<tool_call>[...]` where the marker came as text;
- and the array form of `mistral`'s `[TOOL_CALLS]` (services/tokenizer/tool_parsers/mistral.py).

A call is a call from its name on: its arguments object's text streams as generated (when
max_tokens cuts it, the call keeps the text generated, in `parse` and streaming alike), the rest
of each array element is dropped ("parameters" is read as "arguments"). An array whose first
element is in another shape is read whole once it ends; if it never ends or does not parse as
calls, the marker and what follows stay in the content, as does a marker not followed by `[`.
Text before the marker is content, as is text after the array.
"""

from __future__ import annotations

import json

from services.tokenizer.tool_parsers.base import Scan, ScannedCall, ToolParser, make_call
from services.tokenizer.tool_parsers.scanning import (
    Header,
    Region,
    json_extent,
    match_json_header,
    match_literals,
    scan_marked,
    skip_whitespace,
)

ARGUMENT_KEYS = ('"arguments"', '"parameters"')


def array_calls(text: str, start: int, final: bool) -> Region | None:
    """`[{"name": ..., "arguments": {...}}, ...]` from `start` (its `[`), as far as it goes."""
    calls: list[ScannedCall] = []
    pos = start + 1
    while True:
        header = match_json_header(text, pos, ARGUMENT_KEYS)
        if not isinstance(header, Header):
            if calls:  # a cut or broken later element ends the calls
                return Region(calls, None)
            return whole_array(text, start, final)
        end, closed = json_extent(text, header.arguments_start, final)
        calls.append(ScannedCall(header.name, text[header.arguments_start : end]))
        if closed:
            end, closed = json_extent(text, end, final, depth=1)  # the element's own "}"
        if not closed:
            return Region(calls, None)
        after = match_literals(text, end, (",", "]"))
        if after is None or after is False:
            return Region(calls, None)
        if text[int(after) - 1] == "]":
            return Region(calls, int(after))
        pos = int(after)


def whole_array(text: str, start: int, final: bool) -> Region | None:
    """An array in another shape, read once it ends; None while it may still."""
    try:
        value, end = json.JSONDecoder().raw_decode(text, start)
    except (ValueError, RecursionError):
        return Region(None, start) if final else None
    calls = [make_call(v.get("name"), v.get("arguments", {})) for v in value if isinstance(v, dict)]
    if not calls or len(calls) != len(value) or None in calls:
        return Region(None, start)
    return Region([call for call in calls if call is not None], end)


def read_array(text: str, body: int, final: bool) -> Region | None:
    """The region after a marker at `body`: an array of calls, content, or None while the
    text so far cannot tell."""
    pos = skip_whitespace(text, body)
    if pos == len(text):
        return Region(None, body) if final else None
    if text[pos] != "[":
        return Region(None, body)
    return array_calls(text, pos, final)


class Phi4MiniJsonToolParser(ToolParser):
    """`functools[...]`, a JSON array of calls (Phi-4-mini)."""

    def scan(self, text: str, final: bool) -> Scan:
        return scan_marked(text, ("functools",), final, read_array)


class GraniteToolParser(ToolParser):
    """`<|tool_call|>[...]` (or `<tool_call>[...]`), a JSON array of calls (Granite 3.x)."""

    def scan(self, text: str, final: bool) -> Scan:
        return scan_marked(text, ("<|tool_call|>", "<tool_call>"), final, read_array)
