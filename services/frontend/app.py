"""The OpenAI-compatible HTTP API. Validates, forwards to the tokenizer pool, streams back.

The frontend never sees tensors and never tokenizes: it turns bodies into GenerateRequests
and text deltas into OpenAI JSON or SSE chunks.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from services.frontend import responses as r
from services.frontend.calls import APICall
from services.frontend.engine_client import EngineClient, EngineUnavailable
from services.frontend.errors import APIError, api_error, bad_request, unavailable
from services.frontend.metrics import Metrics
from services.frontend.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    TokenizeBody,
    decode_body,
)
from shared.config import Config
from shared.protocol import GenerateRequest, ParameterError, TokenizeRequest
from shared.version import VERSION

logger = logging.getLogger(__name__)


class InFlightCounter:
    """Counts HTTP requests from their first byte to their response's last (streams too), so
    a draining server waits for requests not yet registered with the engine as well."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.count = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in ("/health", "/metrics"):
            return await self.app(scope, receive, send)
        self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1


def create_app(config: Config, engine: EngineClient, model_name: str) -> FastAPI:
    app = FastAPI(title="kvflow", version=VERSION)
    app.state.draining = False
    metrics = Metrics(model_name)

    async def admit(request: Request, post: bool = False) -> None:
        """Every route but /health: the API key; for POSTs, draining and the body limit."""
        _authorize(config, request)
        if post:
            if app.state.draining:
                raise unavailable("the server is shutting down")
            await _read_body(config, request)

    @app.exception_handler(APIError)
    async def on_api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Exception)
    async def on_error(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return APIError(500, f"internal error: {exc}", "internal_error").response()

    @app.get("/health")
    async def health() -> Response:
        reason = "draining" if app.state.draining else engine.unavailable_reason()
        if reason is None:
            return Response(status_code=200)
        return unavailable(reason).response()

    @app.get("/version")
    async def version(request: Request) -> dict[str, str]:
        await admit(request)
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        await admit(request)
        max_len = engine.stats.max_model_len if engine.stats else None
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "kvflow",
                    "root": model_name,
                    "max_model_len": max_len,
                }
            ],
        }

    @app.get("/metrics")
    async def prometheus(request: Request) -> PlainTextResponse:
        await admit(request)
        return PlainTextResponse(
            metrics.render(engine.stats), media_type="text/plain; version=0.0.4"
        )

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        await admit(request, post=True)
        body = _decode(request, TokenizeBody)
        result = await _tokenize(
            engine,
            TokenizeRequest(
                request_id=_new_id("tok"),
                prompt=body.prompt,
                messages=body.chat_messages(),
                add_special_tokens=body.add_special_tokens,
            ),
        )
        return {
            "count": len(result.token_ids),
            "max_model_len": engine.stats.max_model_len if engine.stats else None,
            "tokens": result.token_ids,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        await admit(request, post=True)
        try:
            tokens = _decode(request, DetokenizeBody).token_ids()
        except ParameterError as exc:
            raise bad_request(exc) from None
        result = await _tokenize(
            engine, TokenizeRequest(request_id=_new_id("tok"), token_ids=tokens)
        )
        return {"prompt": result.text}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        await admit(request, post=True)
        body = _decode(request, CompletionRequest)
        _check_model(body.model, model_name)
        try:
            prompts = body.prompts()
            params = body.sampling_params(body.max_tokens, body.logprobs)
            if body.echo and body.logprobs is not None:
                raise ParameterError("echo", "echo together with logprobs is not supported")
        except ParameterError as exc:
            raise bad_request(exc) from None
        request_id = _new_id("cmpl")
        subs = [
            GenerateRequest(
                request_id=f"{request_id}-{p * body.n + j}",
                sampling_params=child,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=prompt if isinstance(prompt, list) else None,
                echo=body.echo,
                arrival_time=time.time(),
            )
            for p, prompt in enumerate(prompts)
            for j, child in enumerate(params.fan_out())
        ]
        call = APICall(engine, metrics, request_id, model_name, subs, len(prompts))
        if body.stream:
            return await call.stream(
                request, body.include_usage, completion=True, logprobs=body.logprobs is not None
            )
        choices = await call.collect(request)
        return JSONResponse(
            r.completion_body(
                request_id, model_name, choices, len(prompts), body.logprobs is not None
            )
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        await admit(request, post=True)
        body = _decode(request, ChatCompletionRequest)
        _check_model(body.model, model_name)
        try:
            messages = body.chat_messages()
            max_tokens = body.max_completion_tokens or body.max_tokens
            params = body.sampling_params(max_tokens, body.num_logprobs)
        except ParameterError as exc:
            raise bad_request(exc) from None
        request_id = _new_id("chatcmpl")
        subs = [
            GenerateRequest(
                request_id=f"{request_id}-{j}",
                sampling_params=child,
                messages=messages,
                arrival_time=time.time(),
            )
            for j, child in enumerate(params.fan_out())
        ]
        call = APICall(engine, metrics, request_id, model_name, subs, 1)
        if body.stream:
            return await call.stream(
                request, body.include_usage, completion=False, logprobs=body.logprobs
            )
        choices = await call.collect(request)
        return JSONResponse(r.chat_body(request_id, model_name, choices, body.logprobs))

    app.state.metrics = metrics
    return app


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(
            404,
            f"The model `{requested}` does not exist.",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _decode(request: Request, kind: type) -> Any:
    try:
        return decode_body(request.state.body, kind)
    except ParameterError as exc:
        raise bad_request(exc) from None


async def _tokenize(engine: EngineClient, request: TokenizeRequest) -> Any:
    try:
        result = await engine.tokenize(request)
    except EngineUnavailable as exc:
        raise unavailable(str(exc)) from None
    if result.error is not None:
        raise api_error(result.error)
    return result


def _authorize(config: Config, request: Request) -> None:
    if config.api_key is None or request.url.path == "/health":
        return
    header = request.headers.get("authorization", "")
    token = header[7:] if header.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(token.encode(), config.api_key.encode()):
        raise APIError(
            401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
        )


async def _read_body(config: Config, request: Request) -> None:
    """Read the body once, refusing it (413) as soon as it passes the limit."""
    limit = config.max_request_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body exceeds {limit} bytes", "invalid_request_error")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes", "invalid_request_error")
        chunks.append(chunk)
    request.state.body = b"".join(chunks)
