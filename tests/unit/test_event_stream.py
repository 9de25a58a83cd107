"""A stream whose client stopped reading ends, and its body iterator is closed (which is what
aborts the request's sub-requests); a client that reads gets every event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.frontend.routes import event_stream
from services.frontend.routes.event_stream import EventStream


def run_stream(send_blocks_after: int | None) -> tuple[list[bytes], bool]:
    """Stream 5 events to a `send` that blocks forever after `send_blocks_after` messages;
    what was sent, and whether the body iterator's cleanup ran."""
    closed = False

    async def events() -> AsyncIterator[bytes]:
        nonlocal closed
        try:
            for k in range(5):
                yield f"data: {k}\n\n".encode()
        finally:
            closed = True

    sent: list[bytes] = []

    async def send(message: dict) -> None:
        if send_blocks_after is not None and len(sent) >= send_blocks_after:
            await asyncio.Event().wait()  # a full socket that never drains
        sent.append(message.get("body", b""))

    asyncio.run(EventStream(events(), "req-1").stream_response(send))
    return sent, closed


def test_a_client_that_stops_reading_is_dropped_and_its_stream_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(event_stream, "STREAM_SEND_TIMEOUT_S", 0.05)
    sent, closed = run_stream(send_blocks_after=3)
    assert len(sent) == 3 and closed  # start + 2 events went; the third send never ended


def test_a_client_that_reads_gets_every_event() -> None:
    sent, closed = run_stream(send_blocks_after=None)
    assert sent[1:6] == [f"data: {k}\n\n".encode() for k in range(5)] and closed
