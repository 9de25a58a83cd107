"""OpenAI's Responses API answers: the response object and its output items, built from the
one choice a response has, and the stream of typed events the OpenAI SDK reads.

Output items come in the order they began: the reasoning (with --reasoning-parser), the message
(its text), then one `function_call` item per tool call. The stream opens each item when its
first piece arrives and closes every open item at the end, then sends `response.completed`
(or `response.incomplete` when `max_output_tokens` cut it) with the whole response, the same
object a non-streamed call returns and the store keeps.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.frontend.api import responses as r
from services.frontend.api.errors import APIError
from services.frontend.api.responses_request import ResponsesRequest, input_items
from services.frontend.api.sse import event
from shared.protocol import TextDelta


@dataclass
class ResponsesCall:
    """What a response repeats of its request, and where it is kept once done."""

    body: ResponsesRequest
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    # Called with the finished response and the conversation so far (its items), to store it.
    on_finished: Callable[[dict[str, Any], list[dict[str, Any]]], None] | None = None

    def item_id(self, kind: str, index: int = 0) -> str:
        return f"{kind}_{self.id.removeprefix('resp_')}{index or ''}"


def response_object(
    call: ResponsesCall, model: str, choice: r.Choice | None, order: list[str] | None = None
) -> dict[str, Any]:
    """The response: in progress (no choice yet) or finished."""
    body = call.body
    status, incomplete = "in_progress", None
    if choice is not None and choice.finish_reason is not None:
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": call.id,
        "object": "response",
        "created_at": call.created_at,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": [] if choice is None else output_items(call, choice, order),
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning,
        "store": body.store,
        "temperature": body.temperature,
        "text": {"format": {"type": "text"}} if body.text is None else _text_config(body),
        "tool_choice": body.tool_choice or "auto",
        "tools": [_without_none(msgspec.structs.asdict(t)) for t in body.tools or []],
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": None if choice is None else usage(choice),
        "user": body.user,
        "metadata": body.metadata or {},
    }


def _text_config(body: ResponsesRequest) -> dict[str, Any]:
    form = body.text.format if body.text is not None else None
    if form is None:
        return {"format": {"type": "text"}}
    return {"format": _without_none(msgspec.structs.asdict(form))}


def _without_none(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def usage(choice: r.Choice) -> dict[str, Any]:
    return {
        "input_tokens": choice.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": choice.num_cached_tokens},
        "output_tokens": choice.num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": choice.num_reasoning_tokens},
        "total_tokens": choice.num_prompt_tokens + choice.num_output_tokens,
    }


def output_items(
    call: ResponsesCall, choice: r.Choice, order: list[str] | None = None
) -> list[dict[str, Any]]:
    """The finished choice's items, in `order` (the keys a stream opened them in) or in the
    natural one: the message, then the calls."""
    text = "".join(choice.text)
    natural = ["reasoning"] if choice.reasoning else []
    natural += ["message"] if text or not choice.tool_calls else []
    natural += [f"call{i}" for i in sorted(choice.tool_calls)]
    return [_item(call, choice, key, "completed") for key in order or natural]


def _item(call: ResponsesCall, choice: r.Choice, key: str, status: str) -> dict[str, Any]:
    if key == "message":
        return message_item(call, "".join(choice.text), status)
    if key == "reasoning":
        return reasoning_item(call, "".join(choice.reasoning), status)
    index = int(key.removeprefix("call"))
    tool_call = choice.tool_calls[index]
    return function_call_item(
        call, index, tool_call.id, tool_call.name, tool_call.arguments, status
    )


def message_item(call: ResponsesCall, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text)]
    item_id = call.item_id("msg")
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def reasoning_item(call: ResponsesCall, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_reasoning_text(text)]
    item_id = call.item_id("rs")
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(
    call: ResponsesCall, index: int, call_id: str, name: str, arguments: list[str], status: str
) -> dict[str, Any]:
    return {
        "id": call.item_id("fc", index + 1),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": "".join(arguments),
        "status": status,
    }


def finished_response(
    call: ResponsesCall, model: str, choice: r.Choice, order: list[str] | None
) -> dict[str, Any]:
    """The finished response, kept in the store when the request asked for it."""
    response = response_object(call, model, choice, order)
    if call.on_finished is not None and call.body.store:
        call.on_finished(response, [*input_items(call.body), *response["output"]])
    return response


class ResponsesStream:
    """The typed events of one streamed response (sse.StreamWriter)."""

    def __init__(self, call: ResponsesCall, model: str) -> None:
        self.call, self.model = call, model
        self.sequence = 0
        self.order: list[str] = []  # the output items' keys, as they were opened
        self.open: set[str] = set()

    def _event(self, payload: dict[str, Any]) -> bytes:
        payload["sequence_number"] = self.sequence
        self.sequence += 1
        return event(payload)

    def opening(self) -> list[bytes]:
        response = response_object(self.call, self.model, None)
        return [
            self._event({"type": "response.created", "response": response}),
            self._event({"type": "response.in_progress", "response": response}),
        ]

    def on_delta(self, choice: r.Choice, delta: TextDelta) -> list[bytes]:
        events: list[bytes] = []
        if delta.reasoning:
            if "reasoning" not in self.open:
                events += self._open_reasoning()
            events.append(self._part_delta("reasoning", "rs", delta.reasoning))
        if delta.text:
            if "reasoning" in self.open:
                events += self._close("reasoning", choice)
            if "message" not in self.open:
                events += self._open_message()
            events.append(self._text_delta(delta.text))
        for piece in delta.tool_calls:
            key = f"call{piece.index}"
            if key not in self.open and piece.name is not None:
                for earlier in ("reasoning", "message"):
                    events += self._close(earlier, choice) if earlier in self.open else []
                events += self._open_call(piece.index, piece.id or "", piece.name)
            if piece.arguments:
                item_id = self.call.item_id("fc", piece.index + 1)
                events.append(
                    self._event(
                        {
                            "type": "response.function_call_arguments.delta",
                            "item_id": item_id,
                            "output_index": self.order.index(key),
                            "delta": piece.arguments,
                        }
                    )
                )
        return events

    def _open_message(self) -> list[bytes]:
        self.order.append("message")
        self.open.add("message")
        index = self.order.index("message")
        item_id = self.call.item_id("msg")
        return [
            self._event(
                {
                    "type": "response.output_item.added",
                    "output_index": index,
                    "item": message_item(self.call, None, "in_progress"),
                }
            ),
            self._event(
                {
                    "type": "response.content_part.added",
                    "item_id": item_id,
                    "output_index": index,
                    "content_index": 0,
                    "part": _output_text(""),
                }
            ),
        ]

    def _open_reasoning(self) -> list[bytes]:
        self.order.append("reasoning")
        self.open.add("reasoning")
        item = reasoning_item(self.call, None, "in_progress")
        added = {"type": "response.output_item.added", "output_index": len(self.order) - 1}
        return [self._event(added | {"item": item})]

    def _part_delta(self, key: str, kind: str, text: str) -> bytes:
        """A reasoning text delta (its item holds one content part)."""
        return self._event(
            {
                "type": "response.reasoning_text.delta",
                "item_id": self.call.item_id(kind),
                "output_index": self.order.index(key),
                "content_index": 0,
                "delta": text,
            }
        )

    def _text_delta(self, text: str) -> bytes:
        return self._event(
            {
                "type": "response.output_text.delta",
                "item_id": self.call.item_id("msg"),
                "output_index": self.order.index("message"),
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            }
        )

    def _open_call(self, index: int, call_id: str, name: str) -> list[bytes]:
        key = f"call{index}"
        self.order.append(key)
        self.open.add(key)
        item = function_call_item(self.call, index, call_id, name, [], "in_progress")
        added = {"type": "response.output_item.added", "output_index": len(self.order) - 1}
        return [self._event(added | {"item": item})]

    def _close(self, key: str, choice: r.Choice) -> list[bytes]:
        """The done events of an open item, with its whole content."""
        self.open.discard(key)
        index = self.order.index(key)
        item = _item(self.call, choice, key, "completed")
        events = []
        if key == "reasoning":
            text = item["content"][0]["text"]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(
                self._event({"type": "response.reasoning_text.done", "text": text} | where)
            )
        elif key == "message":
            text = item["content"][0]["text"]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(
                self._event(
                    {"type": "response.output_text.done", "text": text, "logprobs": []} | where
                )
            )
            events.append(
                self._event(
                    {"type": "response.content_part.done", "part": item["content"][0]} | where
                )
            )
        else:
            events.append(
                self._event(
                    {
                        "type": "response.function_call_arguments.done",
                        "item_id": item["id"],
                        "output_index": index,
                        "name": item["name"],
                        "arguments": item["arguments"],
                    }
                )
            )
        events.append(
            self._event({"type": "response.output_item.done", "output_index": index, "item": item})
        )
        return events

    def closing(self, choices: list[r.Choice]) -> list[bytes]:
        [choice] = choices
        events = [
            e for key in list(self.order) if key in self.open for e in self._close(key, choice)
        ]
        response = finished_response(self.call, self.model, choice, self.order or None)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [*events, self._event({"type": kind, "response": response})]

    def on_error(self, error: APIError) -> list[bytes]:
        details = error.body()["error"]
        return [
            self._event(
                {
                    "type": "error",
                    "code": details.get("code"),
                    "message": details["message"],
                    "param": details.get("param"),
                }
            )
        ]
