"""One API call in flight: its sub-requests (prompts x n), their choices, its metrics, and
whether its client is still there."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import Response

from services.frontend.api import responses as r
from services.frontend.api.endpoints import CallPlan
from services.frontend.api.errors import APIError, api_error, queue_full, timed_out, unavailable
from services.frontend.engine.client import (
    EngineClient,
    EngineUnavailable,
    Idle,
    QueueFull,
    RequestTimeout,
)
from services.frontend.metrics.prometheus import Metrics
from services.frontend.metrics.request_log import record_of
from services.frontend.routes.event_stream import EventStream
from shared.constants import SSE_KEEPALIVE_S
from shared.protocol import ErrorKind, TextDelta

T = TypeVar("T")
Item = tuple[r.Choice, TextDelta] | Idle  # Idle: nothing came for SSE_KEEPALIVE_S


class APICall:
    """One API call: its sub-requests, their choices, metrics, and the client's presence."""

    def __init__(
        self, engine: EngineClient, metrics: Metrics, plan: CallPlan, request: Request
    ) -> None:
        self.engine, self.metrics, self.plan, self.request = engine, metrics, plan, request
        self.choices = {
            s.request_id: r.Choice(i, s.tool_choice) for i, s in enumerate(plan.sub_requests)
        }
        self.start = time.monotonic()
        self.last_token_at: dict[str, float] = {}
        # The deadline, on the event loop's clock (what asyncio.timeout_at reads).
        loop_now = asyncio.get_running_loop().time()
        self.deadline = None if plan.timeout is None else loop_now + plan.timeout
        self.timed_out = False
        record_of(request).request_id = plan.request_id

    async def respond(self) -> Response:
        """Run the call: an SSE stream, or the whole body once every choice has finished."""
        try:
            self.engine.check_available()
            self.engine.check_queue_room()
        except EngineUnavailable as exc:
            raise unavailable(str(exc)) from None
        except QueueFull as exc:
            self.metrics.refused["queue_full"] += 1
            raise queue_full(str(exc)) from None
        if self.plan.stream:
            return await self._stream()
        await self._unless_disconnected(self._consume())
        body = self.plan.endpoint.response_body(self.plan, list(self.choices.values()))
        # msgspec, as the streamed chunks (api/sse.py): a batch of 32 embeddings of 1,024
        # floats encodes in 1.4 ms, against 26 ms with json.dumps (JSONResponse).
        return Response(msgspec.json.encode(body), media_type="application/json")

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

    async def _deltas(self) -> AsyncGenerator[Item, None]:
        idle_after = SSE_KEEPALIVE_S if self.plan.stream else None
        generate = self.engine.generate(self.plan.sub_requests, self.deadline, idle_after)
        try:
            # aclosing: leaving early (an error, a client gone) aborts the other
            # sub-requests now, not whenever the generator is garbage-collected.
            async with contextlib.aclosing(generate) as deltas:
                async for delta in deltas:
                    if isinstance(delta, Idle):
                        yield delta
                        continue
                    self._observe(delta)
                    choice = self.choices[delta.request_id]
                    if delta.error is not None:
                        choice.finish_reason = "error"
                        if delta.error.kind is ErrorKind.QUEUE_FULL:
                            self.metrics.refused["queue_full"] += 1
                        raise api_error(delta.error)
                    choice.absorb(delta)
                    yield choice, delta
        except EngineUnavailable as exc:
            raise unavailable(str(exc)) from None
        except RequestTimeout:
            self.timed_out = True
            raise timed_out(self.plan.timeout) from None
        finally:
            # Requests left unfinished here were aborted (client gone, an error, the deadline).
            unfinished = sum(c.finish_reason is None for c in self.choices.values())
            self.metrics.finished["timeout" if self.timed_out else "abort"] += unfinished
            self._record_usage()

    def _record_usage(self) -> None:
        usage = r.usage(list(self.choices.values()), self.plan.num_prompts)
        record = record_of(self.request)
        record.num_prompt_tokens = usage["prompt_tokens"]
        record.num_completion_tokens = usage["completion_tokens"]

    async def _consume(self) -> None:
        async for _ in self._deltas():
            pass

    async def _stream(self) -> Response:
        deltas = self._deltas()
        # Wait for the first delta so that an invalid prompt is still a plain 400, or a 429; a
        # request that waits longer than SSE_KEEPALIVE_S starts its stream with a keep-alive.
        first = await self._unless_disconnected(anext(deltas, None))
        return EventStream(self._events(first, deltas), self.plan.request_id)

    async def _events(
        self, first: Item | None, deltas: AsyncGenerator[Item, None]
    ) -> AsyncIterator[bytes]:
        writer = self.plan.endpoint.stream_writer(self.plan)
        try:
            for chunk in writer.opening():
                yield chunk
            item = first
            while item is not None:
                if isinstance(item, Idle):
                    yield b": keep-alive\n\n"  # an SSE comment: clients skip it
                else:
                    for chunk in writer.on_delta(*item):
                        yield chunk
                item = await anext(deltas, None)
            for chunk in writer.closing(list(self.choices.values())):
                yield chunk
        except APIError as exc:
            for chunk in writer.on_error(exc):
                yield chunk
        finally:
            await deltas.aclose()

    async def _unless_disconnected(self, work: Awaitable[T]) -> T:
        """Run `work`; if the client disconnects first, cancel it (which aborts its requests)."""
        task = asyncio.ensure_future(work)

        async def wait_disconnect() -> None:
            while (await self.request.receive())["type"] != "http.disconnect":
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
