"""The OpenAI-compatible HTTP API. Validates, forwards to the tokenizer pool, streams back.

The frontend never sees tensors and never tokenizes: it turns bodies into GenerateRequests
and text deltas into OpenAI JSON or SSE chunks.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from services.frontend import responses as r
from services.frontend.engine_client import EngineClient, EngineUnavailable
from services.frontend.metrics import Metrics
from services.frontend.openai_types import ChatCompletionRequest, CompletionRequest, decode_body
from shared.config import Config
from shared.protocol import (
    GenerateRequest,
    ParameterError,
    SamplingParams,
    TextDelta,
    TokenizeRequest,
)

logger = logging.getLogger(__name__)
VERSION = "0.1.0"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(exc: ParameterError | str, param: str | None = None) -> APIError:
    if isinstance(exc, ParameterError):
        return APIError(400, str(exc), "invalid_request_error", exc.param)
    return APIError(400, exc, "invalid_request_error", param)


def unavailable(reason: str) -> APIError:
    return APIError(503, f"the engine is unavailable: {reason}", "service_unavailable")


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
        if engine.ready and not app.state.draining:
            return Response(status_code=200)
        return unavailable(
            engine.down or ("draining" if app.state.draining else "starting")
        ).response()

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
        body = _json_object(request.state.body)
        messages = body.get("messages")
        result = await _tokenize(
            engine,
            TokenizeRequest(
                request_id=_new_id("tok"),
                prompt=body.get("prompt"),
                messages=msgspec.convert(messages, list[ChatMessageIn]) if messages else None,
                add_special_tokens=bool(body.get("add_special_tokens", True)),
            ),
        )
        return {
            "count": len(result.token_ids),
            "max_model_len": result.max_model_len,
            "tokens": result.token_ids,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        await admit(request, post=True)
        tokens = _json_object(request.state.body).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise bad_request("tokens must be a list of token ids", "tokens")
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
                sampling_params=_child(params, j),
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=prompt if isinstance(prompt, list) else None,
                echo=body.echo,
                arrival_time=time.time(),
            )
            for p, prompt in enumerate(prompts)
            for j in range(body.n)
        ]
        call = _Call(engine, metrics, request_id, model_name, subs, len(prompts))
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
                sampling_params=_child(params, j),
                messages=messages,
                arrival_time=time.time(),
            )
            for j in range(body.n)
        ]
        call = _Call(engine, metrics, request_id, model_name, subs, 1)
        if body.stream:
            return await call.stream(
                request, body.include_usage, completion=False, logprobs=body.logprobs
            )
        choices = await call.collect(request)
        return JSONResponse(r.chat_body(request_id, model_name, choices, body.logprobs))

    app.state.metrics = metrics
    return app


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str


class _Call:
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
        if self.engine.num_pending >= self.engine.config.max_queued_requests:
            raise APIError(429, "too many requests are waiting; retry later", "rate_limit_error")
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
            async for delta in self.engine.generate(self.subs):
                self._observe(delta)
                choice = self.choices[delta.request_id]
                if delta.error is not None:
                    raise (
                        bad_request(delta.error, delta.error_param)
                        if delta.error_param
                        else unavailable(delta.error)
                    )
                choice.absorb(delta)
                yield choice, delta
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


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _child(params: SamplingParams, index: int) -> SamplingParams:
    seed = None if params.seed is None else params.seed + index
    return msgspec.structs.replace(params, n=1, seed=seed)


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


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise bad_request(f"invalid JSON: {exc}", "body") from None
    if not isinstance(value, dict):
        raise bad_request("the body must be a JSON object", "body")
    return value


async def _tokenize(engine: EngineClient, request: TokenizeRequest) -> Any:
    try:
        result = await engine.tokenize(request)
    except EngineUnavailable as exc:
        raise unavailable(str(exc)) from None
    if result.error is not None:
        raise bad_request(result.error, result.error_param)
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
