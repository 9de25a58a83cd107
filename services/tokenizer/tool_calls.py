"""A chat's tool calls, read from its output text as it streams, by the request's ToolChoice.

- AUTO: the model's own format, read by the server's --tool-call-parser (tool_parsers/).
- REQUIRED: a grammar made the output a JSON array of {"name", "parameters"} objects; it is
  read at the end. When max_tokens cut the array, the calls complete before the cut are
  returned (the finish reason, "length", says the rest is missing).
- FUNCTION: a grammar made the output the named function's arguments: the call is announced
  at once and the text streams as its arguments.

With `parallel_tool_calls: false`, every mode yields one call at most: the first.

Each returns, per piece of text, the content to send and the tool-call pieces (ToolCallDelta).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from services.tokenizer.tool_parsers import ParsedDelta, new_call_id, tool_parser
from services.tokenizer.tool_parsers.scanning import match_literals, skip_whitespace
from shared.protocol import ToolCallDelta, ToolChoice, ToolDefinition


class ToolCallReader:
    """Reads one choice's output; `feed` per piece of text, `finish` at the end."""

    def __init__(
        self,
        choice: ToolChoice,
        name: str | None,
        parser_name: str | None,
        parallel: bool = True,
        tools: Sequence[ToolDefinition] | None = None,
    ) -> None:
        self.choice = choice
        self.name = name
        self.parallel = parallel  # False: calls after the first are dropped
        self.parser = (
            tool_parser(parser_name, tools) if choice is ToolChoice.AUTO and parser_name else None
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
            pieces = required_calls("".join(self._held))
            return "", [piece for piece in pieces if self.parallel or piece.index == 0]
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


def complete_elements(text: str) -> list[object]:
    """The elements of the JSON array `text` that are complete, also when a cut ended it
    early (after them, a cut element or nothing); [] when it is no array."""
    decoder = json.JSONDecoder()
    elements: list[object] = []
    pos = match_literals(text, 0, ("[",))
    while isinstance(pos, int) and not isinstance(pos, bool):  # False: no `[` or `,` next
        try:
            element, pos = decoder.raw_decode(text, skip_whitespace(text, pos))
        except (ValueError, RecursionError):  # the cut element, or the array's end
            return elements
        if pos == len(text) and isinstance(element, int | float):
            return elements  # a number at the cut may have been cut short
        elements.append(element)
        pos = match_literals(text, pos, (",",))
    return elements


def required_calls(text: str) -> list[ToolCallDelta]:
    """The calls of a REQUIRED output, two pieces each (name, then arguments): those complete
    before the end, which max_tokens may have cut."""
    pieces: list[ToolCallDelta] = []
    calls = [c for c in complete_elements(text) if isinstance(c, dict)]
    for call in calls:
        if not isinstance(call.get("name"), str):
            continue
        index = len(pieces) // 2
        arguments = json.dumps(call.get("parameters", {}), ensure_ascii=False)
        pieces.append(ToolCallDelta(index=index, id=new_call_id(), name=call["name"]))
        pieces.append(ToolCallDelta(index=index, arguments=arguments))
    return pieces
