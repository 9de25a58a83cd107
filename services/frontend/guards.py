"""What a request passes before its route runs, as FastAPI dependencies (create_app says which
routes take which): the API key; for POSTs also draining and the body-size limit."""

from __future__ import annotations

import hmac

from fastapi import Request

from services.frontend.errors import APIError, unavailable
from services.frontend.state import frontend_state


async def authorize(request: Request) -> None:
    """With --api-key, a matching bearer token (compared in constant time), else 401."""
    api_key = frontend_state(request).config.api_key
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    token = header[7:] if header.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        raise APIError(
            401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
        )


async def admit(request: Request) -> None:
    """POST routes: the API key; then 503 while draining; then the body, read once into
    `request.state.body`."""
    await authorize(request)
    state = frontend_state(request)
    if state.draining:
        raise unavailable("the server is shutting down")
    request.state.body = await read_body(request, state.config.max_request_body_bytes)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused (413) as soon as it passes `limit` bytes, declared or sent."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", "invalid_request_error")
