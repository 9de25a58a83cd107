"""`qwen3_coder` (Qwen3-Coder, Qwen3-Coder-Next): optional text, then blocks

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between its tags, less one newline on each side, converted by
the JSON Schema type the request's tools give it (integer, number, boolean, null, object,
array; else, or when it does not read as that type, a string).

A block is a call from `<function=name>` on. Its arguments stream as a JSON object built one
parameter at a time: `{` at once, each parameter when `</parameter>` ends it (its type needs
the whole value), `}` at `</function>` (or `</tool_call>`). When max_tokens cuts the call, it
keeps what was built, without the `}` and without a parameter whose value was cut, in `parse`
and streaming alike. A block that does not open with `<function=name>` stays in the content.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.tokenizer.tool_parsers.arguments import convert_text
from services.tokenizer.tool_parsers.base import Scan, ScannedCall, ToolParser, schema_types
from services.tokenizer.tool_parsers.scanning import (
    Region,
    match_literals,
    object_text,
    scan_marked,
)
from shared.protocol import ToolDefinition

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"


def _strip_newline(value: str) -> str:
    """The value between its tags, less the newline the format puts on each side."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _next_tag(text: str, pos: int) -> tuple[int, str] | None:
    """The next of <parameter=, </function>, </tool_call> at or after `pos`."""
    at = text.find(PARAMETER_START, pos)
    limit = len(text) if at < 0 else at  # the end tags are looked for before it only
    ends = [(text.find(tag, pos, limit), tag) for tag in (FUNCTION_END, TOOL_CALL_END)]
    found = [(end_at, tag) for end_at, tag in ends if end_at >= 0]
    if found:
        return min(found)
    return None if at < 0 else (at, PARAMETER_START)


class Qwen3CoderToolParser(ToolParser):
    """`<tool_call><function=name><parameter=p>value</parameter>...` blocks (Qwen3-Coder)."""

    def __init__(self, tools: Sequence[ToolDefinition] | None = None) -> None:
        super().__init__(tools)
        self._types = schema_types(self.tools)  # parameter types by tool, then parameter
        # Each scan reads the whole output again: a parameter already whole is converted once.
        self._converted: dict[tuple[str, str, str], object] = {}

    def scan(self, text: str, final: bool) -> Scan:
        return scan_marked(text, TOOL_CALL_START, final, self._read_block)

    def _read_block(self, text: str, body: int, final: bool) -> Region | None:
        after = match_literals(text, body, (FUNCTION_START,))
        if after is None:
            return Region(None, body) if final else None
        if after is False:
            return Region(None, body)
        close = text.find(">", int(after))
        name = text[int(after) : len(text) if close < 0 else close]
        if "\n" in name or "<" in name or (close >= 0 and not name.strip()):
            return Region(None, body)
        if close < 0:
            return Region(None, body) if final else None
        name = name.strip()
        arguments, end = self._parameters(text, name, close + 1)
        return Region([ScannedCall(name, arguments)], end)

    def _parameters(self, text: str, name: str, pos: int) -> tuple[str, int | None]:
        """The function's arguments text so far, and where its block ends (None: not yet)."""
        arguments: list[tuple[str, object]] = []
        while (tag := _next_tag(text, pos)) is not None:
            at, kind = tag
            if kind != PARAMETER_START:
                close = at if kind == TOOL_CALL_END else text.find(TOOL_CALL_END, at)
                end = None if close < 0 else close + len(TOOL_CALL_END)
                return object_text(arguments, closed=True), end
            key_end = text.find(">", at)
            value_end = -1 if key_end < 0 else text.find(PARAMETER_END, key_end)
            if value_end < 0:
                break
            key = text[at + len(PARAMETER_START) : key_end].strip()
            value = _strip_newline(text[key_end + 1 : value_end])
            arguments.append((key, self._convert(name, key, value)))
            pos = value_end + len(PARAMETER_END)
        return object_text(arguments, closed=False), None

    def _convert(self, name: str, key: str, value: str) -> object:
        """A parameter's value by its type in the tool's schema (see the module docstring)."""
        converted = self._converted.get((name, key, value), self._converted)
        if converted is self._converted:  # not converted yet
            schema_type = self._types.get(name, {}).get(key)
            converted = self._converted[name, key, value] = convert_text(value, schema_type)
        return converted
