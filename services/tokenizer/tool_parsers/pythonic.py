"""`pythonic` (Llama 3.2 and Llama 4 with their pythonic prompts, ToolACE): the whole output is
a Python list of calls with keyword arguments, optionally between `<|python_start|>` and
`<|python_end|>`:

    [get_weather(city="Paris", days=3), get_time(timezone="Europe/Paris")]

An output that starts `[name(` is calls from then on (anything else, from its first
characters on, is all content). Each call's id and name go out at `name(`; its arguments
stream as a JSON object built one argument at a time, each when the `,` or `)` after it
shows it whole, `}` at the `)`. Values are read with `ast.literal_eval` (never eval); one that
is not a literal JSON can hold is kept as its source text; positional arguments are dropped.
When max_tokens cuts a call, it keeps what was built, without the `}` and without the cut
argument, in `parse` and streaming alike. After the list, whitespace is dropped and other
text is content.
"""

from __future__ import annotations

import re

from services.tokenizer.tool_parsers.arguments import literal_value
from services.tokenizer.tool_parsers.base import Scan, ScannedCall, ToolParser
from services.tokenizer.tool_parsers.scanning import (
    MAYBE,
    NO,
    Header,
    HeaderMatch,
    match_literals,
    object_text,
    skip_whitespace,
)

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][\w.]*")
# A Python token for splitting arguments: a string (triple-quoted or not, possibly
# unterminated), a bracket or comma, or a run of anything else.
_PY_TOKEN = re.compile(
    r'"""(?:[^"\\]|\\.|"(?!""))*(?:"""|\Z)|'
    r"'''(?:[^'\\]|\\.|'(?!''))*(?:'''|\Z)|"
    r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"?|'
    r"'[^'\\\n]*(?:\\.[^'\\\n]*)*'?|"
    r"[()\[\]{},]|[^\"'()\[\]{},]+",
    re.S,
)
_KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=(?!=)(.*)", re.S)


def _call_header(text: str, pos: int) -> HeaderMatch:
    """`name(` at `pos`, after whitespace; the arguments start after the `(`."""
    pos = skip_whitespace(text, pos)
    name = _NAME.match(text, pos)
    if name is None:
        return MAYBE if pos == len(text) else NO
    paren = match_literals(text, name.end(), ("(",))
    if paren is None:  # the name, or the space after it, may still grow
        return MAYBE
    if paren is False:
        return NO
    return Header(name.group(), int(paren))


def _arguments(text: str, start: int) -> tuple[list[tuple[str, object]], int | None]:
    """The keyword arguments whole from `start` on, and the end of the call's `)` (None:
    not yet)."""
    arguments: list[tuple[str, object]] = []
    depth, piece_start = 0, start
    for match in _PY_TOKEN.finditer(text, start):
        token = match.group()
        if token in ("(", "[", "{"):
            depth += 1
        elif token in (")", "]", "}") and depth > 0:
            depth -= 1
        elif depth == 0 and token in (",", ")"):  # one argument is whole
            keyword = _KEYWORD.fullmatch(text, piece_start, match.start())
            if keyword is not None:
                arguments.append((keyword.group(1), literal_value(keyword.group(2))))
            piece_start = match.end()
            if token == ")":
                return arguments, match.end()
    return arguments, None


class PythonicToolParser(ToolParser):
    """The whole output as a Python list of calls, `[f(a=1), g(b="x")]` (Llama 3.2, 4)."""

    def scan(self, text: str, final: bool) -> Scan:
        pos = skip_whitespace(text, 0)
        if PYTHON_START.startswith(text[pos:]) and not final:
            return Scan("")  # maybe the tag, still arriving
        if text.startswith(PYTHON_START, pos):
            pos = skip_whitespace(text, pos + len(PYTHON_START))
        if pos == len(text) and not final:
            return Scan("")
        header = _call_header(text, pos + 1) if text.startswith("[", pos) else NO
        if not isinstance(header, Header):
            return Scan("" if header is MAYBE and not final else text)
        calls: list[ScannedCall] = []
        while isinstance(header, Header):
            arguments, end = _arguments(text, header.arguments_start)
            calls.append(ScannedCall(header.name, object_text(arguments, end is not None)))
            if end is None:
                return Scan("", calls)
            after = match_literals(text, end, (",", "]"))
            if after is None or after is False:
                return Scan("", calls)  # cut, or not a list of calls past here: dropped
            if text[int(after) - 1] == "]":
                return self._after_list(text, int(after), final, calls)
            header = _call_header(text, int(after))
        return Scan("", calls)

    def _after_list(self, text: str, pos: int, final: bool, calls: list[ScannedCall]) -> Scan:
        """The calls, and the text after the list: content unless only whitespace (and the
        closing tag)."""
        tail = text[pos:]
        rest = tail.strip()
        if not final and (not rest or PYTHON_END.startswith(rest)):
            return Scan("", calls)
        return Scan("" if rest in ("", PYTHON_END) else tail, calls)
