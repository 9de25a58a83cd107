"""Parsing a chat model's generated text into OpenAI tool calls (`tool_choice: "auto"`).

Each parser reads one model family's format, under the name vLLM's `--tool-call-parser` uses:

- `hermes` (Hermes 2 Pro, Qwen2.5, Qwen3): optional free text, then one or more blocks

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  A block whose JSON does not parse, is not an object with a string "name" and an object
  "arguments" (absent means `{}`), or has no `</tool_call>` (cut by max_tokens) stays in the
  content as text.
- `llama3_json` (Llama 3.1 / 3.2 JSON tool calling): the whole output is one object
  `{"name": "fn", "parameters": {...}}` ("arguments" is accepted for "parameters"), optionally
  after `<|python_tag|>`, or several such objects separated by `;`. Any other output, including
  one that starts like a call but does not parse as calls in full, is content.

Content (`parse`): with no calls, the output unchanged. With calls, the text outside the call
blocks, where each stretch of text that precedes a call loses its trailing whitespace and a
whitespace-only tail after the last call is dropped; None when nothing is left.

Streaming (`feed`, then `finish`): tokens arrive a few characters at a time, so a marker can be
split across pieces ("<tool_" + "call>"), and a block is known to be a call only once it is
complete and its JSON parses. So text that might still turn out to be part of a call, and
whitespace that would be stripped if a call followed, is held until later pieces decide; all
else goes out at once. For any split of a text, the streamed content adds up to
`parse(text)[0] or ""` and the streamed calls to `parse(text)[1]` (ids aside).
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from shared.protocol import ToolCallDelta  # a streamed piece of a call, as sent

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(slots=True)
class ToolCall:
    """One complete call, as OpenAI's `message.tool_calls[i]` (of type "function")."""

    id: str  # "call_" + 24 hex digits, unique per call
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass(slots=True)
class ParsedDelta:
    """What one piece of streamed text lets us send now."""

    content: str  # text known to be content
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def make_call(name: object, arguments: object) -> ToolCall | None:
    """A call from a decoded name and arguments; None unless a string and an object."""
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


class ToolParser(ABC):
    """Reads one output: `parse()` it whole, or `feed()` it piece by piece, then `finish()`.

    The streaming state belongs to one output: use a fresh parser for each choice.
    """

    def __init__(self) -> None:
        self._num_calls = 0  # calls streamed so far, so the index of the next one

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output: (content, or None when empty and there are calls; calls)."""

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """The next piece of generated text (split anywhere); returns what can be sent now."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """The end of the output: whatever is still held, decided."""

    def _stream_call(self, delta: ParsedDelta, call: ToolCall) -> None:
        """Appends a complete call as OpenAI streams one: id and name, then the arguments."""
        index = self._num_calls
        self._num_calls += 1
        delta.tool_calls.append(ToolCallDelta(index=index, id=call.id, name=call.name))
        delta.tool_calls.append(ToolCallDelta(index=index, arguments=call.arguments))


def _partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def _hermes_call(body: str) -> ToolCall | None:
    """The call written between <tool_call> and </tool_call>; None when malformed."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None
    if not isinstance(obj, dict):
        return None
    return make_call(obj.get("name"), obj.get("arguments", {}))


def _next_block(text: str, pos: int) -> tuple[int, int] | None:
    """(start, end) of the next terminated <tool_call> block at or after `pos`, if any."""
    start = text.find(TOOL_CALL_START, pos)
    if start < 0:
        return None
    close = text.find(TOOL_CALL_END, start + len(TOOL_CALL_START))
    return None if close < 0 else (start, close + len(TOOL_CALL_END))


class HermesToolParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks after optional text (Hermes, Qwen2.5, Qwen3)."""

    def __init__(self) -> None:
        super().__init__()
        # NOTE: outside a block, `_held` is the unsent end of the current stretch of text:
        # trailing whitespace plus a possible start of <tool_call>. Inside one, it is that
        # whitespace, then the block so far, from `_block_start` on.
        self._held = ""
        self._block_start: int | None = None
        self._scan_from = 0  # where to look for </tool_call> next: no match before it
        self._text_since_call = False  # whether non-whitespace content went out since a call

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        pieces: list[str] = []  # the text before each call, without trailing whitespace
        calls: list[ToolCall] = []
        piece_start = scan = 0
        while (block := _next_block(text, scan)) is not None:
            start, end = block
            scan = end
            call = _hermes_call(text[start + len(TOOL_CALL_START) : end - len(TOOL_CALL_END)])
            if call is not None:  # a malformed block stays in its piece of content
                pieces.append(text[piece_start:start].rstrip())
                calls.append(call)
                piece_start = end
        if not calls:
            return text, []
        tail = text[piece_start:]
        content = "".join(pieces) + (tail if tail.strip() else "")
        return content or None, calls

    def feed(self, text: str) -> ParsedDelta:
        delta = ParsedDelta("")
        self._held += text
        while self._step(delta):
            pass
        return delta

    def finish(self) -> ParsedDelta:
        # An unterminated block is content, and so is held whitespace, unless it is a
        # whitespace-only tail after a call.
        keep = self._num_calls == 0 or self._text_since_call or bool(self._held.strip())
        delta = ParsedDelta(self._held if keep else "")
        self._held = ""
        self._block_start = None
        return delta

    def _step(self, delta: ParsedDelta) -> bool:
        """Gets past the next marker; False when the held text does not show one yet."""
        if self._block_start is None:
            return self._open_block(delta)
        return self._close_block(delta, self._block_start)

    def _send(self, delta: ParsedDelta, num_chars: int) -> None:
        """Moves the first `num_chars` held characters to the content."""
        sent, self._held = self._held[:num_chars], self._held[num_chars:]
        delta.content += sent
        self._text_since_call = self._text_since_call or bool(sent.strip())

    def _open_block(self, delta: ParsedDelta) -> bool:
        """Sends the text before the next <tool_call>; True when one was found."""
        start = self._held.find(TOOL_CALL_START)
        if start < 0:
            stem = self._held[: len(self._held) - _partial_marker_len(self._held, TOOL_CALL_START)]
            self._send(delta, len(stem.rstrip()))
            return False
        num_sent = len(self._held[:start].rstrip())
        self._send(delta, num_sent)
        self._block_start = start - num_sent
        self._scan_from = self._block_start + len(TOOL_CALL_START)
        return True

    def _close_block(self, delta: ParsedDelta, block_start: int) -> bool:
        """Streams the open block once </tool_call> ends it; True when it did."""
        close = self._held.find(TOOL_CALL_END, self._scan_from)
        if close < 0:
            self._scan_from = max(self._scan_from, len(self._held) - len(TOOL_CALL_END) + 1)
            return False
        end = close + len(TOOL_CALL_END)
        call = _hermes_call(self._held[block_start + len(TOOL_CALL_START) : close])
        if call is None:  # the block, and the whitespace before it, are content
            self._send(delta, end)
        else:
            self._held = self._held[end:]
            self._stream_call(delta, call)
            self._text_since_call = False
        self._block_start = None
        return True


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _llama3_call(obj: object) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    return make_call(obj.get("name"), obj.get("arguments", obj.get("parameters")))


def _llama3_calls(text: str) -> list[ToolCall]:
    """The calls when the whole text is `[<|python_tag|>]{call}[; {call}...]`, else []."""
    body = text.strip()
    if not body.startswith(("{", PYTHON_TAG)):
        return []
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = len(PYTHON_TAG) if body.startswith(PYTHON_TAG) else 0
    while True:
        try:
            obj, pos = decoder.raw_decode(body, _skip_whitespace(body, pos))
        except (ValueError, RecursionError):
            return []
        call = _llama3_call(obj)
        if call is None:
            return []
        calls.append(call)
        pos = _skip_whitespace(body, pos)
        if pos == len(body):
            return calls
        if body[pos] != ";":
            return []
        pos += 1


def _may_be_llama3_calls(text: str) -> bool | None:
    """Whether an output starting with `text` may be calls; None until its start shows."""
    head = text.lstrip()
    if head.startswith(("{", PYTHON_TAG)):
        return True
    return None if PYTHON_TAG.startswith(head) else False


class Llama3JsonToolParser(ToolParser):
    """The whole output as `{"name": ..., "parameters": ...}` objects (Llama 3.1, 3.2)."""

    def __init__(self) -> None:
        super().__init__()
        self._held = ""
        self._may_be_calls: bool | None = None  # None until the output's first characters show

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = _llama3_calls(text)
        return (None, calls) if calls else (text, [])

    def feed(self, text: str) -> ParsedDelta:
        # NOTE: an output that may be calls is held to the end: whether it is calls depends on
        # all of it, so a call streamed at a `;` could turn out to have been content.
        self._held += text
        if self._may_be_calls is None:
            self._may_be_calls = _may_be_llama3_calls(self._held)
        if self._may_be_calls is not False:
            return ParsedDelta("")
        sent, self._held = self._held, ""
        return ParsedDelta(sent)

    def finish(self) -> ParsedDelta:
        content, calls = self.parse(self._held)
        self._held = ""
        delta = ParsedDelta(content or "")
        for call in calls:
            self._stream_call(delta, call)
        return delta


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def tool_parser(name: str) -> ToolParser:
    """A fresh parser for the format `name` (vLLM's `--tool-call-parser` names)."""
    parser_class = TOOL_PARSERS.get(name)
    if parser_class is None:
        choices = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; choose from {choices}")
    return parser_class()
