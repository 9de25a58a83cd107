"""--enable-log-requests: one log line per API request, written when its response ends.

Routes note what only they know (the request id, the tokens) in the request's RequestRecord;
the RequestLog middleware adds the route, the status and the duration, and logs the line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)
_RECORD = "request_record"  # its key in the request's state (scope["state"])
PROBE_PATHS = ("/health", "/metrics")  # polled every few seconds; not API requests


@dataclass
class RequestRecord:
    """What a route knows of its request that the middleware does not."""

    request_id: str | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0


def record_of(connection: HTTPConnection) -> RequestRecord:
    """The request's record: the middleware's when logging is on, else a new one to ignore."""
    state: dict[str, Any] = connection.scope.setdefault("state", {})
    record: RequestRecord = state.setdefault(_RECORD, RequestRecord())
    return record


def log_line(
    method: str, path: str, status: int | None, record: RequestRecord, duration_s: float
) -> str:
    """The line for one request; status None: it ended before a response was started."""
    return (
        f"{method} {path} request_id={record.request_id or '-'} "
        f"status={status if status is not None else '-'} "
        f"prompt_tokens={record.num_prompt_tokens} "
        f"completion_tokens={record.num_completion_tokens} "
        f"duration={duration_s:.3f}s"
    )


class RequestLog:
    """ASGI middleware: logs each API request (not the probes) once its response has ended."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            return await self.app(scope, receive, send)
        record = RequestRecord()
        scope.setdefault("state", {})[_RECORD] = record
        status: int | None = None
        start = time.monotonic()

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        except Exception:
            status = status or 500  # what the outermost error handler is about to answer
            raise
        finally:
            duration = time.monotonic() - start
            logger.info(log_line(scope["method"], scope["path"], status, record, duration))
