"""Anthropic's Messages API answers: the message and its content blocks, built from the one
choice a message has, and the stream of named events the `anthropic` SDK reads
(`message_start`, then per block `content_block_start`, `content_block_delta`s and
`content_block_stop`, then `message_delta` with the stop reason and `message_stop`).

Blocks come in the order they began: `thinking` (with --reasoning-parser), text, then one
`tool_use` block per call, whose input streams as `input_json_delta` pieces.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.frontend.api import responses as r
from services.frontend.api.errors import APIError
from services.frontend.api.sse import event
from shared.protocol import TextDelta

# Anthropic's error types by HTTP status (its SDK raises by status, and shows the type).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error(error: APIError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


@dataclass
class MessagesCall:
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex[:24]}")


def stop_reason(choice: r.Choice) -> str | None:
    if choice.finish_reason is None:
        return None
    if choice.finish_reason == "length":
        return "max_tokens"
    if choice.tool_calls and choice.finish_reason in ("tool_calls", "stop"):
        return "tool_use"  # a named tool's call ends with "stop" in chat, as OpenAI's does
    return "stop_sequence" if choice.stop_reason is not None else "end_turn"


def usage(choice: r.Choice) -> dict[str, Any]:
    return {
        "input_tokens": choice.num_prompt_tokens,
        "output_tokens": choice.num_output_tokens,
        "cache_read_input_tokens": choice.num_cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def message_body(call: MessagesCall, model: str, choice: r.Choice | None) -> dict[str, Any]:
    """The message: empty at its start (a stream's message_start), or finished."""
    return {
        "id": call.id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [] if choice is None else content_blocks(choice),
        "stop_reason": None if choice is None else stop_reason(choice),
        "stop_sequence": None if choice is None else choice.stop_reason,
        "usage": usage(choice) if choice is not None else _no_usage(),
    }


def _no_usage() -> dict[str, Any]:
    return {"input_tokens": 0, "output_tokens": 0}


def content_blocks(choice: r.Choice) -> list[dict[str, Any]]:
    text, thinking = "".join(choice.text), "".join(choice.reasoning)
    blocks = [_thinking(thinking)] if thinking else []
    blocks += [{"type": "text", "text": text}] if text or not choice.tool_calls else []
    return blocks + [_tool_use(choice.tool_calls[i]) for i in sorted(choice.tool_calls)]


def _thinking(text: str) -> dict[str, Any]:
    # The signature Anthropic's API checks when thinking is sent back; this server drops
    # earlier thinking from prompts, so it signs nothing.
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use(call: r.ToolCall) -> dict[str, Any]:
    arguments = "".join(call.arguments)
    try:
        given = json.loads(arguments) if arguments else {}
    except ValueError:  # cut by max_tokens mid-arguments
        given = {}
    return {"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name, "input": given}


def _tool_use_id(call_id: str) -> str:
    """Anthropic's spelling of a call's id ("toolu_..."), which its client sends back."""
    return "toolu_" + call_id.removeprefix("call_")


class MessagesStream:
    """The named events of one streamed message (sse.StreamWriter)."""

    def __init__(self, call: MessagesCall, model: str) -> None:
        self.call, self.model = call, model
        self.blocks: list[str] = []  # "text" or "call<i>", in the order they began
        self.open: str | None = None  # the block taking deltas now

    def opening(self) -> list[bytes]:
        return [
            event({"type": "message_start", "message": message_body(self.call, self.model, None)})
        ]

    def on_delta(self, choice: r.Choice, delta: TextDelta) -> list[bytes]:
        events: list[bytes] = []
        if delta.reasoning:
            events += self._start("thinking", _thinking(""))
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.text:
            events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.text}))
        for piece in delta.tool_calls:
            key = f"call{piece.index}"
            if piece.name is not None:
                block = {
                    "type": "tool_use",
                    "id": _tool_use_id(piece.id or ""),
                    "name": piece.name,
                    "input": {},
                }
                events += self._start(key, block)
            if piece.arguments and self.open == key:
                events.append(
                    self._delta({"type": "input_json_delta", "partial_json": piece.arguments})
                )
        return events

    def _start(self, key: str, block: dict[str, Any]) -> list[bytes]:
        if self.open == key:
            return []
        events = self._stop()
        self.blocks.append(key)
        self.open = key
        index = len(self.blocks) - 1
        return [
            *events,
            event({"type": "content_block_start", "index": index, "content_block": block}),
        ]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})

    def _stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event({"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def closing(self, choices: list[r.Choice]) -> list[bytes]:
        [choice] = choices
        events = self._stop()
        said = {"stop_reason": stop_reason(choice), "stop_sequence": choice.stop_reason}
        events.append(event({"type": "message_delta", "delta": said, "usage": usage(choice)}))
        return [*events, event({"type": "message_stop"})]

    def on_error(self, error: APIError) -> list[bytes]:
        return [event(anthropic_error(error))]
