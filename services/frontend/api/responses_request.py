"""OpenAI's Responses API request (`POST /v1/responses`), translated onto a chat completion:
the one internal request every chat API becomes (endpoints.py `read_chat`).

- `input`: a string (one user message) or items: messages (`role` user, system, developer,
  assistant; text content), `function_call` (a call the model made) and
  `function_call_output` (its result). `reasoning` items are dropped: chat templates do not
  take earlier turns' thinking back. `instructions` come first, as a system message.
- `tools` (function tools only; hosted tools are refused by name), `tool_choice`,
  `parallel_tool_calls`; `text.format` (`json_schema`, `json_object`, `text`);
  `max_output_tokens`, `temperature`, `top_p`, `top_logprobs`, `stream`.
- `previous_response_id`: the stored conversation of that response comes before `input`
  (its instructions do not carry over, as OpenAI's do not).

What is not served is refused by name, never ignored: background mode, conversations,
prompt templates, images and files, `truncation: "auto"`, `max_tool_calls`, `include`.
"""

from __future__ import annotations

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


class TextFormat(msgspec.Struct, kw_only=True):
    type: str = "text"  # "text", "json_object" or "json_schema"
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesTool(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: Int64 | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    # Not served: refused by name when set.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    max_tool_calls: Int64 | None = None
    truncation: str | None = None
    service_tier: str | None = None

    @property
    def include_usage(self) -> bool:
        return True  # the response object always carries its usage


def check_served(body: ResponsesRequest) -> None:
    """A 400 naming the first field asking for what this server does not do."""
    refused = {
        "background": body.background and "background mode is not served",
        "conversation": body.conversation is not None and "conversations are not served",
        "prompt": body.prompt is not None and "prompt templates are not served",
        "include": body.include and "no additional output data is served",
        "max_tool_calls": body.max_tool_calls is not None and "not served",
        "truncation": body.truncation not in (None, "disabled") and "only disabled is served",
        "service_tier": body.service_tier not in (None, "auto", "default") and "not served",
    }
    for field, reason in refused.items():
        if reason:
            raise ParameterError(field, str(reason))
    if body.reasoning and body.reasoning.get("effort") not in (None, "medium"):
        raise ParameterError("reasoning", "reasoning effort is set by the model's template")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise ParameterError("text", "verbosity is not served")


def to_chat(body: ResponsesRequest, earlier: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion `body` asks for, after the `earlier` conversation's items."""
    check_served(body)
    items = input_items(body)
    messages = [Message(role="system", content=body.instructions)] if body.instructions else []
    messages += chat_messages([*earlier, *items])
    return ChatCompletionRequest(
        messages=messages,
        model=body.model,
        stream=body.stream,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        logprobs=body.top_logprobs is not None,
        top_logprobs=body.top_logprobs,
        tools=[_tool(tool) for tool in body.tools] if body.tools else None,
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text),
        user=body.user,
    )


def chat_messages(items: list[dict[str, Any]]) -> list[Message]:
    """Input items as chat messages; an assistant's text and the calls after it are one
    message, as chat templates expect."""
    messages: list[Message] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(Message(role=_role(item), content=_text(item.get("content"))))
        elif kind == "function_call":
            call = ToolCallBody(
                id=_string(item, "call_id"),
                function=FunctionCallBody(
                    name=_string(item, "name"), arguments=_string(item, "arguments")
                ),
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(Message(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output)
            messages.append(
                Message(role="tool", content=text, tool_call_id=_string(item, "call_id"))
            )
        elif kind != "reasoning":
            raise ParameterError("input", f"input items of type {kind!r} are not served")
    if not messages:
        raise ParameterError("input", "must hold at least one message")
    return messages


def _role(item: dict[str, Any]) -> str:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise ParameterError(
            "input", f"a message's role must be user, system, developer or assistant, not {role!r}"
        )
    return str(role)


def _text(content: Any) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ParameterError("input", "a message's content must be a string or a list of parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ParameterError("input", f"only text input is served, not {kind!r} parts")
        texts.append(_string(part, "text"))
    return "".join(texts)


def _string(item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ParameterError(
            "input", f"an item of type {item.get('type', 'message')!r} needs a string {key!r}"
        )
    return value


def _tool(tool: ResponsesTool) -> Tool:
    if tool.type != "function":
        raise ParameterError(
            "tools", f"hosted tools are not served ({tool.type!r}); use function tools"
        )
    if tool.name is None:
        raise ParameterError("tools", "a function tool needs a name")
    function = FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
    )
    return Tool(function=function)


def _tool_choice(choice: str | dict[str, Any] | None) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return NamedToolChoice(function=NamedFunction(name=choice["name"]))
    raise ParameterError("tool_choice", "must be none, auto, required or {type: function, name}")


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    form = text.format if text is not None else None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return ResponseFormat(type="json_object")
    if form.type == "json_schema":
        schema = JSONSchemaFormat(
            name=form.name, description=form.description, schema=form.schema, strict=form.strict
        )
        return ResponseFormat(type="json_schema", json_schema=schema)
    raise ParameterError("text", f"text.format type {form.type!r} is not served")


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """This turn's input as items (a string is one user message)."""
    return [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
