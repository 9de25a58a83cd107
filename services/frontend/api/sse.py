"""How a streamed call's answer is written as server-sent events: each API its own events,
over one flow (routes/calls.py). Chat and completions send OpenAI chunks, a usage chunk when
asked, and `data: [DONE]`; the Responses and Messages APIs send typed events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from services.frontend.api import responses as r
from services.frontend.api.errors import APIError
from shared.protocol import TextDelta

# (request_id, model, choice, delta, logprobs) -> a chunk, or None: nothing to send for it
ChunkBuilder = Callable[[str, str, r.Choice, TextDelta, bool], dict[str, Any] | None]
DONE = b"data: [DONE]\n\n"


class StreamWriter(Protocol):
    """The events of one streamed call, as bytes to send."""

    def opening(self) -> list[bytes]:
        """Before the first delta."""
        ...

    def on_delta(self, choice: r.Choice, delta: TextDelta) -> list[bytes]:
        """`delta`, already absorbed into `choice`."""
        ...

    def closing(self, choices: list[r.Choice]) -> list[bytes]:
        """After the last delta of every choice."""
        ...

    def on_error(self, error: APIError) -> list[bytes]:
        """The call failed mid-stream; nothing follows."""
        ...


def data(payload: dict[str, Any]) -> bytes:
    encoded: bytes = msgspec.json.encode(payload)
    return b"data: " + encoded + b"\n\n"


def event(payload: dict[str, Any]) -> bytes:
    """A typed event, named by its payload's `type` (the Responses and Messages APIs)."""
    name: str = payload["type"]
    return b"event: " + name.encode() + b"\n" + data(payload)


class ChunkStream:
    """OpenAI's chat and completions chunks."""

    def __init__(
        self,
        chunk: ChunkBuilder,
        chunk_object: str,
        request_id: str,
        model: str,
        logprobs: bool,
        include_usage: bool,
        num_prompts: int,
    ) -> None:
        self.chunk, self.chunk_object = chunk, chunk_object
        self.request_id, self.model, self.logprobs = request_id, model, logprobs
        self.include_usage, self.num_prompts = include_usage, num_prompts

    def opening(self) -> list[bytes]:
        return []

    def on_delta(self, choice: r.Choice, delta: TextDelta) -> list[bytes]:
        chunk = self.chunk(self.request_id, self.model, choice, delta, self.logprobs)
        return [] if chunk is None else [data(chunk)]

    def closing(self, choices: list[r.Choice]) -> list[bytes]:
        if not self.include_usage:
            return [DONE]
        usage = r.usage(choices, self.num_prompts)
        return [data(r.usage_chunk(self.request_id, self.model, self.chunk_object, usage)), DONE]

    def on_error(self, error: APIError) -> list[bytes]:
        return [data(error.body()), DONE]
