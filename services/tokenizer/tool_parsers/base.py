"""What every tool-call parser shares: the call types and the streaming driver.

A parser is one pure function, `scan(text, final)`: what the output so far (`final`: the whole
output) says for sure, as content and calls (name, arguments text known so far). `parse` is the
final scan; `feed` scans the text so far and sends what grew since the last scan.

NOTE: each parser's `scan` is monotone: the scan of a prefix of an output is a prefix of the
scan of the output (its content a prefix of the content, its calls a prefix of the calls, each
call's arguments a prefix of the arguments), and a non-final scan is a prefix of the final one.
So for any split of an output, the streamed pieces add up to `parse(text)` (ids aside). The
property tests check this for every parser.

Rescanning costs O(length) per piece; the scanners walk with `str.find` and regular
expressions, so it stays C work for outputs of a few thousand tokens.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.protocol import ToolCallDelta, ToolDefinition


@dataclass(slots=True)
class ToolCall:
    """One call, as OpenAI's `message.tool_calls[i]` (of type "function")."""

    id: str  # "call_" + 24 hex digits (mistral: 9 letters and digits), unique per call
    name: str
    arguments: str  # the arguments object as JSON text (incomplete when cut by max_tokens)


@dataclass(slots=True)
class ParsedDelta:
    """What one piece of streamed text lets us send now."""

    content: str  # text known to be content
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(slots=True)
class ScannedCall:
    """A call as far as the text shows it: its name, and its arguments' text known so far."""

    name: str
    arguments: str


@dataclass(slots=True)
class Scan:
    """What a text says for sure: its content so far and its calls so far."""

    content: str
    calls: list[ScannedCall] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def make_call(name: object, arguments: object) -> ScannedCall | None:
    """A call from a decoded name and arguments; None unless a string and an object."""
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return ScannedCall(name, json.dumps(arguments, ensure_ascii=False))


def schema_types(tools: Sequence[ToolDefinition] | None) -> dict[str, dict[str, object]]:
    """Each tool's parameters' JSON Schema `type`, by tool name then parameter name."""
    types: dict[str, dict[str, object]] = {}
    for tool in tools or []:
        try:
            schema = json.loads(tool.parameters)
        except ValueError:
            continue
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if isinstance(properties, dict):
            types[tool.name] = {
                key: prop.get("type") for key, prop in properties.items() if isinstance(prop, dict)
            }
    return types


class ToolParser(ABC):
    """Reads one output: `parse()` it whole, or `feed()` it piece by piece, then `finish()`.

    The streaming state belongs to one output: use a fresh parser for each choice.
    """

    def __init__(self, tools: Sequence[ToolDefinition] | None = None) -> None:
        self.tools = list(tools or [])  # the request's tools (some formats need their types)
        self._text = ""  # the output so far
        self._sent_content = 0  # characters of the scan's content sent so far
        self._sent_arguments: list[int] = []  # per call: characters of its arguments sent

    def call_id(self) -> str:
        """A new call's id; a format whose chat template checks ids gives its own."""
        return new_call_id()

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """What `text` says for sure; `final`: it is the whole output. Must be monotone."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output: (content, or None when empty and there are calls; calls)."""
        scan = self.scan(text, final=True)
        calls = [ToolCall(self.call_id(), call.name, call.arguments) for call in scan.calls]
        return (scan.content or None) if calls else scan.content, calls

    def feed(self, text: str) -> ParsedDelta:
        """The next piece of generated text (split anywhere); returns what can be sent now."""
        self._text += text
        return self._grown(self.scan(self._text, final=False))

    def finish(self) -> ParsedDelta:
        """The end of the output: whatever is still held, decided."""
        return self._grown(self.scan(self._text, final=True))

    def _grown(self, scan: Scan) -> ParsedDelta:
        """What `scan` adds to what was sent: new content, new calls, more arguments."""
        delta = ParsedDelta(scan.content[self._sent_content :])
        self._sent_content = len(scan.content)
        for index, call in enumerate(scan.calls):
            if index == len(self._sent_arguments):  # a new call: its id and name first
                self._sent_arguments.append(0)
                delta.tool_calls.append(
                    ToolCallDelta(index=index, id=self.call_id(), name=call.name)
                )
            arguments = call.arguments[self._sent_arguments[index] :]
            if arguments:
                self._sent_arguments[index] = len(call.arguments)
                delta.tool_calls.append(ToolCallDelta(index=index, arguments=arguments))
        return delta
