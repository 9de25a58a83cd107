"""A chat's tool calls, read from its output text as it streams, by the request's ToolChoice.

- AUTO: the model's own format, read by the server's --tool-call-parser (tool_parsers.py).
- REQUIRED: a grammar made the output a JSON array of {"name", "parameters"} objects; it is
  read whole at the end (a partial array names no call for sure).
- FUNCTION: a grammar made the output the named function's arguments: the call is announced
  at once and the text streams as its arguments.

Each returns, per piece of text, the content to send and the tool-call pieces (ToolCallDelta).
"""

from __future__ import annotations

import json

from services.tokenizer.tool_parsers import ParsedDelta, new_call_id, tool_parser
from shared.protocol import ToolCallDelta, ToolChoice


class ToolCallReader:
    """Reads one choice's output; `feed` per piece of text, `finish` at the end."""

    def __init__(
        self, choice: ToolChoice, name: str | None, parser_name: str | None, parallel: bool = True
    ) -> None:
        self.choice = choice
        self.name = name
        self.parallel = parallel  # False: calls after the first are dropped (AUTO; the
        # grammars of REQUIRED and FUNCTION already allow one)
        self.parser = (
            tool_parser(parser_name) if choice is ToolChoice.AUTO and parser_name else None
        )
        self._held: list[str] = []  # REQUIRED: the array so far
        self._announced = False  # FUNCTION: the call's first piece has gone out

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.parser is not None:
            return self._auto(self.parser.feed(text))
        if self.choice is ToolChoice.REQUIRED:
            self._held.append(text)
            return "", []
        if self.choice is ToolChoice.FUNCTION:
            return "", self._function_pieces(text)
        return text, []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self.parser is not None:
            return self._auto(self.parser.finish())
        if self.choice is ToolChoice.REQUIRED:
            return "", required_calls("".join(self._held))
        if self.choice is ToolChoice.FUNCTION:
            return "", self._function_pieces("")
        return "", []

    def _function_pieces(self, text: str) -> list[ToolCallDelta]:
        pieces = []
        if not self._announced:
            self._announced = True
            pieces.append(ToolCallDelta(index=0, id=new_call_id(), name=self.name))
        if text:
            pieces.append(ToolCallDelta(index=0, arguments=text))
        return pieces

    def _auto(self, parsed: ParsedDelta) -> tuple[str, list[ToolCallDelta]]:
        calls = [d for d in parsed.tool_calls if self.parallel or d.index == 0]
        return parsed.content, calls


def required_calls(text: str) -> list[ToolCallDelta]:
    """The calls of a REQUIRED output, two pieces each (name, then arguments); none when the
    array is cut short (max_tokens), which leaves the finish reason to say so."""
    try:
        calls = json.loads(text)
    except ValueError:
        return []
    pieces = []
    for index, call in enumerate(calls if isinstance(calls, list) else []):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = json.dumps(call.get("parameters", {}), ensure_ascii=False)
        pieces.append(ToolCallDelta(index=index, id=new_call_id(), name=call["name"]))
        pieces.append(ToolCallDelta(index=index, arguments=arguments))
    return pieces
