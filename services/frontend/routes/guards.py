"""What a request passes before its route runs, as FastAPI dependencies (create_app says which
routes take which): the API key; for POSTs also draining and the body-size limit."""

from __future__ import annotations

import hmac
from pathlib import Path

from fastapi import Request

from services.frontend.api.errors import APIError, unavailable
from services.frontend.routes.state import frontend_state
from shared.config import Config, ConfigError


def load_api_keys(config: Config) -> tuple[bytes, ...]:
    """The keys --api-key (comma-separated) and --api-key-file (one per line) give."""
    keys = [k.strip() for k in (config.api_key or "").split(",")]
    if config.api_key_file is not None:
        path = Path(config.api_key_file)
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"--api-key-file: cannot read {path}: {exc.strerror}") from None
        keys += [line.strip() for line in lines if not line.strip().startswith("#")]
        if not any(keys):
            raise ConfigError(f"--api-key-file: {path} holds no key")
    return tuple(k.encode() for k in keys if k)


async def authorize(request: Request) -> None:
    """With API keys set, a bearer token (or, as Anthropic's clients send it, an `x-api-key`
    header) matching one of them, else 401. Every key is compared, each in constant time, so
    the time taken tells nothing of which one (nearly) matched."""
    keys = frontend_state(request).api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    bearer = header[7:] if header.lower().startswith("bearer ") else ""
    token = (bearer or request.headers.get("x-api-key", "")).encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    if not matched:
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
