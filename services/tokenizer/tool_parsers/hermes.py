"""`hermes` (Hermes 2 Pro, Qwen2.5, Qwen3): optional text, then one or more blocks

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block that starts `{"name": "...", "arguments": {` is a call from then on: its id and name
go out, then the arguments object's text as it is generated, up to its closing brace (or up to
`</tool_call>` outside a string, or the end of the output when max_tokens cut it: the
arguments are then the text generated, incomplete JSON, in `parse` and streaming alike). The
rest of the block up to `</tool_call>` (or up to the next `<tool_call>`, when the model left
out the end tag) is dropped. A block in another shape is read whole at
`</tool_call>` (keys in another order, no "arguments" meaning `{}`); if that does not parse
as a call, or the block never ends, it stays in the content as text.
"""

from __future__ import annotations

import json

from services.tokenizer.tool_parsers.base import Scan, ScannedCall, ToolParser, make_call
from services.tokenizer.tool_parsers.scanning import (
    Header,
    Region,
    json_extent,
    match_json_header,
    scan_marked,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
ARGUMENT_KEYS = ('"arguments"', '"parameters"')


def _whole_block_call(body: str) -> ScannedCall | None:
    """The call written between <tool_call> and </tool_call>; None when malformed."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None
    if not isinstance(obj, dict):
        return None
    return make_call(obj.get("name"), obj.get("arguments", {}))


def _streamed_block(text: str, header: Header, final: bool) -> Region:
    """The call whose header was read: its arguments so far, and the block's end."""
    start = header.arguments_start
    end, closed = json_extent(text, start, final, stops=(TOOL_CALL_END,))
    call = ScannedCall(header.name, text[start:end])
    if not closed:  # ended by </tool_call>, or still open
        stopped = text.startswith(TOOL_CALL_END, end)
        return Region([call], end + len(TOOL_CALL_END) if stopped else None)
    # The block ends at its </tool_call>, or before the next <tool_call> when the model left
    # out the end tag.
    close = text.find(TOOL_CALL_END, end)
    following = text.find(TOOL_CALL_START, end, None if close < 0 else close)
    if following >= 0:
        return Region([call], following)
    return Region([call], None if close < 0 else close + len(TOOL_CALL_END))


def read_block(text: str, body: int, final: bool) -> Region | None:
    """The region after a <tool_call> at `body`: a call, content, or None while undecided."""
    close = text.find(TOOL_CALL_END, body)
    header = match_json_header(text[: len(text) if close < 0 else close], body, ARGUMENT_KEYS)
    if isinstance(header, Header):
        return _streamed_block(text, header, final)
    if close < 0:  # the block may still become a call
        return Region(None, None) if final else None
    end = close + len(TOOL_CALL_END)
    call = _whole_block_call(text[body:close])
    return Region(None if call is None else [call], end)


class HermesToolParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks after optional text (Hermes, Qwen2.5, Qwen3)."""

    def scan(self, text: str, final: bool) -> Scan:
        return scan_marked(text, TOOL_CALL_START, final, read_block)
