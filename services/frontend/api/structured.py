"""What a body asks of its output's shape: OpenAI's `response_format` and `tools` with
`tool_choice`, and vLLM's `structured_outputs` and `guided_*` fields, as one StructuredOutput
(enforced by a grammar) and how the tokenizer worker reads tool calls from the output.

The grammar itself is checked in the tokenizer pool (shared/grammar.py), which has the
tokenizer; here only the body's shape is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.frontend.api.openai_types import (
    ChatCompletionRequest,
    GenerateBody,
    NamedToolChoice,
    StructuredOutputsBody,
    Tool,
)
from shared.protocol import ParameterError, StructuredOutput, ToolChoice, ToolDefinition


@dataclass(frozen=True)
class ToolRequest:
    """A chat's tools, as the template and the tokenizer worker take them."""

    tools: list[ToolDefinition] | None = None
    choice: ToolChoice | None = None  # None: the output is text only
    name: str | None = None  # the function of ToolChoice.FUNCTION
    parallel: bool = True
    structured_output: StructuredOutput | None = None  # REQUIRED and FUNCTION's grammar


def structured_output(body: GenerateBody) -> StructuredOutput | None:
    """The one constraint among the body's structured-output fields; 400 for two."""
    found = [
        spec
        for spec in (
            _response_format(body),
            _structured_outputs(body.structured_outputs),
            _json_spec(body.guided_json, "guided_json") if body.guided_json is not None else None,
            _spec(body.guided_regex, "guided_regex", regex=body.guided_regex),
            _spec(body.guided_choice, "guided_choice", choice=body.guided_choice),
            _spec(body.guided_grammar, "guided_grammar", grammar=body.guided_grammar),
        )
        if spec is not None
    ]
    if len(found) > 1:
        names = ", ".join(spec.source for spec in found)
        raise ParameterError(found[1].source, f"ask for one structured output, not {names}")
    if found:
        found[0].validate()
    return found[0] if found else None


def _response_format(body: GenerateBody) -> StructuredOutput | None:
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput(json_object=True, source="response_format")
    if response_format.type == "json_schema":
        json_schema = response_format.json_schema
        if json_schema is None or json_schema.schema is None:
            raise ParameterError("response_format", "json_schema needs json_schema.schema")
        return _json_spec(json_schema.schema, "response_format")
    raise ParameterError("response_format", "type must be text, json_object or json_schema")


def _structured_outputs(body: StructuredOutputsBody | None) -> StructuredOutput | None:
    if body is None:
        return None
    schema = body.json
    return StructuredOutput(
        json=None if schema is None else schema if isinstance(schema, str) else json.dumps(schema),
        json_object=bool(body.json_object),
        regex=body.regex,
        choice=body.choice,
        grammar=body.grammar,
        disable_any_whitespace=body.disable_any_whitespace,
        source="structured_outputs",
    )


def _json_spec(schema: str | dict[str, Any], source: str) -> StructuredOutput:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return StructuredOutput(json=text, source=source)


def _spec(value: object, source: str, **kind: Any) -> StructuredOutput | None:
    return None if value is None else StructuredOutput(source=source, **kind)


# ---------------------------------------------------------------------------- tools


def tool_request(body: ChatCompletionRequest) -> ToolRequest:
    """The chat's tools and how its output is read; 400 for a choice the tools do not fit."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise ParameterError("tool_choice", "needs tools")
        return ToolRequest()
    tools = [tool_definition(tool) for tool in body.tools]
    parallel = body.parallel_tool_calls
    if choice == "none":
        return ToolRequest(tools=tools)
    if choice in (None, "auto"):
        return ToolRequest(tools=tools, choice=ToolChoice.AUTO, parallel=parallel)
    if choice == "required":
        schema = _required_schema(body.tools, parallel)
        spec = StructuredOutput(json=json.dumps(schema), source="tools")
        return ToolRequest(tools, ToolChoice.REQUIRED, None, parallel, spec)
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in body.tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise ParameterError("tool_choice", f"no tool is named {choice.function.name!r}")
        spec = StructuredOutput(json=json.dumps(_parameters(tool)), source="tools")
        return ToolRequest(tools, ToolChoice.FUNCTION, tool.function.name, parallel, spec)
    raise ParameterError("tool_choice", "must be none, auto, required or a named function")


def tool_definition(tool: Tool) -> ToolDefinition:
    if tool.type != "function":
        raise ParameterError("tools", f"unsupported tool type {tool.type!r}")
    function = tool.function
    return ToolDefinition(
        name=function.name,
        description=function.description,
        parameters=json.dumps(_parameters(tool)),
    )


def _parameters(tool: Tool) -> dict[str, Any]:
    # No parameters means a function of none (OpenAI's reading).
    return tool.function.parameters or {"type": "object", "properties": {}}


def _required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more calls, each {"name": <a tool>, "parameters": <its schema>}:
    the format ToolCallReader reads for ToolChoice.REQUIRED, whatever the model's own."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        array["maxItems"] = 1
    return array
