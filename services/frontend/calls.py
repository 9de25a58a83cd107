"""One API call in flight: its sub-requests (prompts x n), their choices, its metrics, and
whether its client is still there."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from services.frontend import responses as r
from services.frontend.engine_client import EngineClient, EngineUnavailable
from services.frontend.errors import APIError, api_error, unavailable
from services.frontend.metrics import Metrics
from shared.protocol import GenerateRequest, TextDelta


class APICall:
    """One API call: its sub-requests, their choices, metrics, and the client's presence."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: Metrics,
        request_id: str,
        model: str,
        subs: list[GenerateRequest],
        num_prompts: int,
    ) -> None:
        self.engine, self.metrics, self.request_id, self.model = engine, metrics, request_id, model
        self.subs, self.num_prompts = subs, num_prompts
        self.choices = {s.request_id: r.Choice(i) for i, s in enumerate(subs)}
        self.start = time.monotonic()
        self.last_token_at: dict[str, float] = {}

    def _check_pressure(self) -> None:
        try:
            self.engine.check_available()
        except EngineUnavailable as exc:
            raise unavailable(str(exc)) from None

    def _observe(self, delta: TextDelta) -> None:
        now = time.monotonic()
        last = self.last_token_at.get(delta.request_id)
        if delta.token_ids:
            if last is None:
                self.metrics.ttft.observe(now - self.start)
            else:
                self.metrics.itl.observe((now - last) / len(delta.token_ids))
            self.last_token_at[delta.request_id] = now
        if delta.finish_reason is not None:
            self.metrics.finished[delta.finish_reason.value] += 1
            self.metrics.e2e.observe(now - self.start)

    async def _deltas(self) -> AsyncIterator[tuple[r.Choice, TextDelta]]:
        try:
            # aclosing: leaving early (an error, a client gone) aborts the other
            # sub-requests now, not whenever the generator is garbage-collected.
            async with contextlib.aclosing(self.engine.generate(self.subs)) as deltas:
                async for delta in deltas:
                    self._observe(delta)
                    choice = self.choices[delta.request_id]
                    if delta.error is not None:
                        choice.finish_reason = "error"
                        raise api_error(delta.error)
                    choice.absorb(delta)
                    yield choice, delta
        except EngineUnavailable as exc:
            raise unavailable(str(exc)) from None
        finally:
            # Requests left unfinished here were aborted (client gone, or an error).
            unfinished = sum(c.finish_reason is None for c in self.choices.values())
            self.metrics.finished["abort"] += unfinished

    async def collect(self, request: Request) -> list[r.Choice]:
        self._check_pressure()

        async def consume() -> None:
            async for _ in self._deltas():
                pass

        await _unless_disconnected(request, consume())
        return list(self.choices.values())

    async def stream(
        self, request: Request, include_usage: bool, completion: bool, logprobs: bool
    ) -> Response:
        self._check_pressure()
        deltas = self._deltas()
        # Wait for the first delta so that an invalid prompt is still a plain 400.
        first = await _unless_disconnected(request, anext(deltas, None))
        return StreamingResponse(
            self._events(first, deltas, include_usage, completion, logprobs),
            media_type="text/event-stream",
        )

    async def _events(
        self,
        first: Any,
        deltas: AsyncIterator,
        include_usage: bool,
        completion: bool,
        logprobs: bool,
    ) -> AsyncIterator[bytes]:
        started: set[int] = set()
        try:
            item = first
            while item is not None:
                choice, delta = item
                if completion:
                    text = (delta.prompt_text or "") + delta.text
                    chunk = r.completion_chunk(
                        self.request_id, self.model, choice, delta, text, logprobs
                    )
                else:
                    chunk = r.chat_chunk(
                        self.request_id,
                        self.model,
                        choice,
                        delta,
                        choice.index not in started,
                        logprobs,
                    )
                started.add(choice.index)
                yield _sse(chunk)
                item = await anext(deltas, None)
            if include_usage:
                obj = "text_completion" if completion else "chat.completion.chunk"
                body = r.usage(list(self.choices.values()), self.num_prompts)
                yield _sse(r.usage_chunk(self.request_id, self.model, obj, body))
        except APIError as exc:
            yield _sse(exc.body())
        finally:
            await deltas.aclose()
        yield b"data: [DONE]\n\n"


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Run `work`; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise APIError(499, "client disconnected", "client_closed_request")
    return task.result()


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"
