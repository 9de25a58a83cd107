"""An SSE response that gives up on a client that stopped reading.

uvicorn's `send` waits while the connection's write buffer is full (flow control), so a
client that stops reading without closing its socket would park its stream forever while the
engine keeps generating for it. Each send here may wait at most STREAM_SEND_TIMEOUT_S; past
that the stream ends, which aborts its requests (the body iterator is closed), and the
connection is dropped.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from shared.constants import STREAM_SEND_TIMEOUT_S

logger = logging.getLogger(__name__)


class ClientStoppedReading(Exception):
    pass


class EventStream(StreamingResponse):
    def __init__(self, content: object, request_id: str) -> None:
        super().__init__(content, media_type="text/event-stream")  # type: ignore[arg-type]
        self.request_id = request_id

    async def stream_response(self, send: Send) -> None:
        async def send_in_time(message: Message) -> None:
            try:
                async with asyncio.timeout(STREAM_SEND_TIMEOUT_S):
                    await send(message)
            except TimeoutError:
                raise ClientStoppedReading from None

        try:
            await super().stream_response(send_in_time)
        except ClientStoppedReading:
            # Returning without the last message makes uvicorn close the connection.
            logger.warning(
                "request_id=%s: the client took no bytes for %g s; dropping its stream",
                self.request_id,
                STREAM_SEND_TIMEOUT_S,
            )
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
