"""`mistral` (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo / Small / Large, Devstral,
Magistral): optional text, then `[TOOL_CALLS]` and either

- a JSON array, `[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]`
  (the older tokenizers), or
- one call, `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`, the marker repeated before each
  further call (the newer tokenizers; an optional `[CALL_ID]id` before `[ARGS]` is skipped;
  what follows the arguments up to the next marker is dropped).

Call ids are 9 letters and digits, as Mistral's chat templates require. A call is a call
from its name on: its arguments object's text streams as generated (when
max_tokens cuts it, the call keeps the text generated, in `parse` and streaming alike), the
rest of each array element is dropped. An array whose first element is in another shape is
read whole once it ends; if it never ends or does not parse as calls, the marker and what
follows stay in the content, and so does a marker followed by neither form.
"""

from __future__ import annotations

import re
import secrets
import string

from services.tokenizer.tool_parsers.base import Scan, ScannedCall, ToolParser
from services.tokenizer.tool_parsers.json_arrays import array_calls
from services.tokenizer.tool_parsers.scanning import (
    MAYBE,
    NO,
    Header,
    HeaderMatch,
    Region,
    json_extent,
    match_literals,
    scan_marked,
    skip_whitespace,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
ARGUMENT_KEYS = ('"arguments"', '"parameters"')
CALL_ID_CHARS = string.ascii_letters + string.digits
_NAME = re.compile(r'[^\s\[\]{}"]*')
_CALL_ID_VALUE = re.compile(r"[^\s\[\]{}]*")


def _named_header(text: str, pos: int) -> HeaderMatch:
    """`name[ARGS]{` (or `name[CALL_ID]id[ARGS]{`) at `pos`."""
    name = _NAME.match(text, pos)
    assert name is not None  # the pattern matches the empty string
    pos = name.end()
    if text.startswith(CALL_ID, pos):
        call_id = _CALL_ID_VALUE.match(text, pos + len(CALL_ID))
        assert call_id is not None
        pos = call_id.end()
    if not text.startswith(ARGS, pos):
        rest = text[pos:]
        return MAYBE if ARGS.startswith(rest) or CALL_ID.startswith(rest) else NO
    if not name.group():
        return NO
    brace = match_literals(text, pos + len(ARGS), ("{",))
    if brace is None:
        return MAYBE
    if brace is False:
        return NO
    return Header(name.group(), int(brace) - 1)


def read_calls(text: str, body: int, final: bool) -> Region | None:
    """The region after a [TOOL_CALLS] at `body`: calls, content, or None while undecided."""
    pos = skip_whitespace(text, body)
    if pos == len(text):
        return Region(None, body) if final else None
    if text[pos] == "[":
        return array_calls(text, pos, final)
    header = _named_header(text, pos)
    if header is MAYBE:
        return Region(None, body) if final else None
    if header is NO or not isinstance(header, Header):
        return Region(None, body)
    start = header.arguments_start
    end, _ = json_extent(text, start, final, stops=(TOOL_CALLS,))
    call = ScannedCall(header.name, text[start:end])
    following = text.find(TOOL_CALLS, end)  # the next call's marker; what is between is dropped
    return Region([call], None if following < 0 else following)


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS]` then a JSON array of calls, or `name[ARGS]{...}` (Mistral models)."""

    def call_id(self) -> str:
        # Mistral's chat templates refuse a conversation whose call ids are not 9 letters and
        # digits, so the ids sent back in an agent loop must be so.
        return "".join(secrets.choice(CALL_ID_CHARS) for _ in range(9))

    def scan(self, text: str, final: bool) -> Scan:
        return scan_marked(text, TOOL_CALLS, final, read_calls)
