"""`llama3_json` (Llama 3.1 / 3.2 JSON tool calling): the output is one call object
`{"name": "fn", "parameters": {...}}` ("arguments" is accepted for "parameters"), optionally
after `<|python_tag|>`, or several such objects separated by `;`.

An output that starts `{"name": "...", "parameters": {` is calls from then on: the arguments
object's text streams as generated (when max_tokens cuts it, the call keeps the text
generated, in `parse` and streaming alike), and the rest of each call object is dropped. After
the calls, a `;` and whitespace are dropped and any other text is content. An output that does
not start so, from its first characters on, is all content.
"""

from __future__ import annotations

import re

from services.tokenizer.tool_parsers.base import Scan, ScannedCall, ToolParser
from services.tokenizer.tool_parsers.scanning import (
    MAYBE,
    NO,
    Header,
    json_extent,
    match_json_header,
    skip_whitespace,
)

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ('"parameters"', '"arguments"')
_SEPARATOR = re.compile(r"\s*;")


class Llama3JsonToolParser(ToolParser):
    """The whole output as `{"name": ..., "parameters": ...}` objects (Llama 3.1, 3.2)."""

    def scan(self, text: str, final: bool) -> Scan:
        pos = skip_whitespace(text, 0)
        if PYTHON_TAG.startswith(text[pos:]) and not final:
            return Scan("")  # maybe the tag, still arriving
        if text.startswith(PYTHON_TAG, pos):
            pos += len(PYTHON_TAG)
        header = match_json_header(text, pos, ARGUMENT_KEYS)
        if not isinstance(header, Header):
            return Scan("" if header is MAYBE and not final else text)
        calls: list[ScannedCall] = []
        tail = ""
        while isinstance(header, Header):
            end, closed = json_extent(text, header.arguments_start, final)
            calls.append(ScannedCall(header.name, text[header.arguments_start : end]))
            if closed:
                end, closed = json_extent(text, end, final, depth=1)  # the call's own "}"
            if not closed:
                return Scan("", calls)
            tail = text[end:]
            separator = _SEPARATOR.match(text, end)
            if separator is not None:
                header = match_json_header(text, separator.end(), ARGUMENT_KEYS)
            else:  # whitespace may still come before a `;`; any other text is content
                header = NO if tail.strip() else MAYBE
        if header is MAYBE and not final:
            return Scan("", calls)
        only_separator = tail.strip() in ("", ";")
        return Scan("" if only_separator else tail, calls)
