"""Parsing a chat model's generated text into OpenAI tool calls (`tool_choice: "auto"`).

One module per model family's format, under the name vLLM's `--tool-call-parser` uses; each
module's docstring gives its format and what happens to malformed or cut calls. `base` holds
the types and the streaming driver, `scanning` the pieces the formats share.

Arguments stream as they are generated: a call's id and name go out as soon as its name is
known, then its arguments text as it arrives. A call cut by max_tokens keeps the arguments
text generated (incomplete JSON), in `parse` and in streaming alike, as vLLM sends them.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.tokenizer.tool_parsers.base import (
    ParsedDelta,
    ToolCall,
    ToolParser,
    new_call_id,
)
from services.tokenizer.tool_parsers.hermes import HermesToolParser
from services.tokenizer.tool_parsers.json_arrays import GraniteToolParser, Phi4MiniJsonToolParser
from services.tokenizer.tool_parsers.llama3_json import Llama3JsonToolParser
from services.tokenizer.tool_parsers.mistral import MistralToolParser
from services.tokenizer.tool_parsers.openai import OpenAiToolParser
from services.tokenizer.tool_parsers.pythonic import PythonicToolParser
from services.tokenizer.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from shared.protocol import ToolCallDelta, ToolDefinition

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "granite": GraniteToolParser,
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "openai": OpenAiToolParser,
    "phi4_mini_json": Phi4MiniJsonToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}

__all__ = [
    "TOOL_PARSERS",
    "ParsedDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "new_call_id",
    "tool_parser",
]


def tool_parser(name: str, tools: Sequence[ToolDefinition] | None = None) -> ToolParser:
    """A fresh parser for the format `name` (vLLM's `--tool-call-parser` names), for a request
    with `tools` (formats that write arguments as text convert them by the tools' schemas)."""
    parser_class = TOOL_PARSERS.get(name)
    if parser_class is None:
        choices = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; choose from {choices}")
    return parser_class(tools)
