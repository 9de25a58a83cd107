"""The API's routes, one router per concern; create_app mounts them behind their guards."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from services.frontend.api.errors import api_error, unavailable
from services.frontend.engine.client import EngineUnavailable
from services.frontend.metrics.request_log import record_of
from shared.protocol import LoraAdapterResult, TokenizeResult

Answer = TypeVar("Answer", TokenizeResult, LoraAdapterResult)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def engine_answer(request: Request, request_id: str, asked: Awaitable[Answer]) -> Answer:
    """The engine's one-message answer to a request (/tokenize, a LoRA load), its error as the
    HTTP error it stands for; 503 when no answer can come."""
    record_of(request).request_id = request_id
    try:
        result = await asked
    except EngineUnavailable as exc:
        raise unavailable(str(exc)) from None
    if result.error is not None:
        raise api_error(result.error)
    return result
