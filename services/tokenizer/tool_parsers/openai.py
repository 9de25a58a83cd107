"""`openai` (gpt-oss): harmony's messages to functions, as the `openai_gptoss` reasoning parser
hands them on in the answer (services/tokenizer/harmony.py):

    <|start|>functions.get_weather<|message|>{"city": "Paris"}<|call|>

A call's name (the recipient after `functions.`) goes out when its `<|message|>` is read, then
its arguments text as it is generated, up to `<|call|>` (or the end of the output when
max_tokens cut it: the arguments are then the text generated). Without the reasoning parser
the output has no such markers, and is all content.
"""

from __future__ import annotations

from services.tokenizer.tool_parsers.base import Scan, ScannedCall, ToolParser
from services.tokenizer.tool_parsers.scanning import Region, partial_marker_len, scan_marked

CALL_START = "<|start|>functions."
MESSAGE = "<|message|>"
CALL_END = "<|call|>"


def read_call(text: str, body: int, final: bool) -> Region | None:
    """The call after `<|start|>functions.` at `body`: its name, its arguments so far."""
    message = text.find(MESSAGE, body)
    if message < 0:  # the name is still coming
        return Region(None, None) if final else None
    start = message + len(MESSAGE)
    name = text[body:message]
    end = text.find(CALL_END, start)
    if end >= 0:
        return Region([ScannedCall(name, text[start:end])], end + len(CALL_END))
    stop = len(text) if final else len(text) - partial_marker_len(text, CALL_END)
    return Region([ScannedCall(name, text[start:stop])], None)


class OpenAiToolParser(ToolParser):
    """harmony's calls to functions (gpt-oss), as the openai_gptoss reader writes them."""

    def scan(self, text: str, final: bool) -> Scan:
        return scan_marked(text, CALL_START, final, read_call)
