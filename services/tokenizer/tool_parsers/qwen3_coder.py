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

from services.tokenizer.tool_parsers.arguments import convert_text
from services.tokenizer.tool_parsers.base import Scan, ScannedCall, ToolParser, schema_types
from services.tokenizer.tool_parsers.scanning import (
    Region,
    match_literals,
    object_text,
    scan_marked,
)

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
    found = [(text.find(tag, pos), tag) for tag in (PARAMETER_START, FUNCTION_END, TOOL_CALL_END)]
    return min(((at, tag) for at, tag in found if at >= 0), default=None)


class Qwen3CoderToolParser(ToolParser):
    """`<tool_call><function=name><parameter=p>value</parameter>...` blocks (Qwen3-Coder)."""

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
        types = schema_types(self.tools).get(name, {})
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
            arguments.append((key, convert_text(value, types.get(key))))
            pos = value_end + len(PARAMETER_END)
        return object_text(arguments, closed=False), None
