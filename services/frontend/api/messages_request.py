"""Anthropic's Messages API request (`POST /v1/messages`), translated onto a chat completion:
the one internal request every chat API becomes (endpoints.py `read_chat`).

- `system` (text, or text blocks) comes first, as a system message.
- `messages`: `user` and `assistant` turns whose content is text or blocks: `text`,
  `tool_use` (an assistant's call: id, name, input object) and `tool_result` (a user's answer
  to one: its text, `is_error` said in it). `thinking` blocks of earlier turns are dropped, as
  chat templates do not take earlier thinking back. Images and documents are refused.
- `tools` (`name`, `description`, `input_schema`) and `tool_choice` (`auto`, `any`,
  `tool` with its name, `none`; `disable_parallel_tool_use`), `stop_sequences`,
  `max_tokens` (required), `output_config.format` (a JSON Schema for the text), `stream`;
  `temperature`, `top_p` and `top_k`, which Anthropic's newer clients send in `extra_body`;
  `thinking` (`enabled` or `disabled`), passed to the chat template as `enable_thinking`.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from services.frontend.api.openai_types import (
    ChatCompletionRequest,
    FunctionCallBody,
    FunctionDefinition,
    Int64,
    JSONSchemaFormat,
    Message,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCallBody,
)
from shared.protocol import ParameterError


class AnthropicTool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; Anthropic's own tools are not served


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: Int64
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its `format`: a JSON Schema for the text
    service_tier: str | None = None

    @property
    def include_usage(self) -> bool:
        return True  # message_start and message_delta always carry usage


class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion `body` asks for."""
    if body.max_tokens < 1:
        raise ParameterError("max_tokens", "must be at least 1")
    if body.thinking is not None and body.thinking.get("type") not in ("enabled", "disabled"):
        raise ParameterError("thinking", "type must be enabled or disabled")
    choice, parallel = _tool_choice(body.tool_choice)
    return ChatCompletionRequest(
        messages=chat_messages(body.system, body.messages),
        model=body.model,
        stream=body.stream,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences,
        tools=chat_tools(body.tools),
        tool_choice=choice if body.tools else None,
        parallel_tool_calls=parallel,
        response_format=_response_format(body.output_config),
        chat_template_kwargs=_thinking(body.thinking),
    )


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    """`thinking` as the switch Qwen3's chat template (and others') reads: `enable_thinking`."""
    if thinking is None:
        return None
    return {"enable_thinking": thinking.get("type") == "enabled"}


def _response_format(config: dict[str, Any] | None) -> ResponseFormat | None:
    if not config:
        return None
    if config.get("effort") is not None:
        raise ParameterError("output_config", "effort is set by the model's template")
    form = config.get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") != "json_schema":
        raise ParameterError("output_config", "format must be {type: json_schema, schema}")
    schema = JSONSchemaFormat(name="output", schema=form.get("schema"))
    return ResponseFormat(type="json_schema", json_schema=schema)


def chat_messages(
    system: str | list[dict[str, Any]] | None, turns: list[dict[str, Any]]
) -> list[Message]:
    messages = [] if not system else [Message(role="system", content=_system_text(system))]
    for turn in turns:
        role = turn.get("role")
        if role not in ("user", "assistant"):
            raise ParameterError(
                "messages", f"a message's role must be user or assistant, not {role!r}"
            )
        content = turn.get("content")
        if isinstance(content, str):
            messages.append(Message(role=role, content=content))
        elif isinstance(content, list):
            messages += _blocks(role, content)
        else:
            raise ParameterError("messages", "content must be a string or a list of blocks")
    if not messages or messages[-1].role == "system":
        raise ParameterError("messages", "must hold at least one message")
    return messages


def _system_text(system: str | list[dict[str, Any]]) -> str:
    if isinstance(system, str):
        return system
    if not all(isinstance(b, dict) and b.get("type") == "text" for b in system):
        raise ParameterError("system", "system blocks must be text")
    return "".join(str(b.get("text", "")) for b in system)


def _blocks(role: str, blocks: list[Any]) -> list[Message]:
    """One turn's blocks: its text (and an assistant's calls) as one message; each tool
    result as a tool message, in order."""
    out: list[Message] = []
    texts: list[str] = []
    calls: list[ToolCallBody] = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            function = FunctionCallBody(name=_string(block, "name"), arguments=arguments)
            calls.append(ToolCallBody(id=_string(block, "id"), function=function))
        elif kind == "tool_result" and role == "user":
            out.append(_tool_result(block))
        elif kind not in ("thinking", "redacted_thinking"):
            raise ParameterError("messages", f"{kind!r} blocks are not served in a {role} turn")
    if texts or calls:
        text = "".join(texts)
        said = Message(role=role, content=text if texts else None, tool_calls=calls or None)
        out = [said, *out] if role == "assistant" else [*out, said]
    return out


def _tool_result(block: dict[str, Any]) -> Message:
    content = block.get("content", "")
    if isinstance(content, list):
        if not all(isinstance(b, dict) and b.get("type") == "text" for b in content):
            raise ParameterError("messages", "tool_result content must be text")
        content = "".join(str(b.get("text", "")) for b in content)
    if not isinstance(content, str):
        raise ParameterError("messages", "tool_result content must be text")
    if block.get("is_error"):
        content = f"Error: {content}"
    return Message(role="tool", content=content, tool_call_id=_string(block, "tool_use_id"))


def _string(block: dict[str, Any], key: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise ParameterError("messages", f"a {block.get('type')!r} block needs a string {key!r}")
    return value


def chat_tools(tools: list[AnthropicTool] | None) -> list[Tool] | None:
    if not tools:
        return None
    out = []
    for tool in tools:
        if tool.type not in (None, "custom"):
            raise ParameterError("tools", f"Anthropic's own tools are not served ({tool.type!r})")
        function = FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.input_schema
        )
        out.append(Tool(function=function))
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[str | NamedToolChoice, bool]:
    """(the chat's tool_choice, whether calls may be parallel)."""
    if choice is None:
        return "auto", True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return NamedToolChoice(function=NamedFunction(name=choice["name"])), parallel
    raise ParameterError("tool_choice", "type must be auto, any, tool (with a name) or none")
