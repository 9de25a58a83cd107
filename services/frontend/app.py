"""The OpenAI-compatible HTTP API. Validates, forwards to the tokenizer pool, streams back.

The frontend never sees tensors and never tokenizes: it turns bodies into GenerateRequests
and text deltas into OpenAI JSON or SSE chunks. This module only assembles the app: its
shared state, its error handlers, and its routers behind their guards.
"""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from services.frontend.api.errors import APIError
from services.frontend.api.limits import RequestLimits
from services.frontend.api.messages_output import anthropic_error
from services.frontend.api.response_store import ResponseStore
from services.frontend.api.validation import Served
from services.frontend.engine.client import EngineClient
from services.frontend.metrics.prometheus import Metrics
from services.frontend.metrics.request_log import RequestLog
from services.frontend.metrics.share import MetricsShare
from services.frontend.routes import (
    embeddings,
    generate,
    info,
    lora,
    messages,
    openapi,
    responses,
    tokenize,
)
from services.frontend.routes.guards import admit, authorize, load_api_keys
from services.frontend.routes.state import FrontendState
from shared.config import Config
from shared.pooling import PoolingConfig
from shared.version import VERSION

logger = logging.getLogger(__name__)


def create_app(
    config: Config, engine: EngineClient, model_name: str, pooling: PoolingConfig | None = None
) -> FastAPI:
    """`pooling`: an embedding model's (shared/pooling.py); None: the model generates."""
    # FastAPI's own /openapi.json and /docs need no key; the document is served by
    # info.router instead, behind the key like /v1/models (see routes/info.py).
    app = FastAPI(title="kvflow", version=VERSION, openapi_url=None, docs_url=None, redoc_url=None)
    openapi.install(app)
    served = Served(model_name, RequestLimits.of(config), config.request_timeout, pooling)
    share = MetricsShare(config.metrics_share_dir) if config.metrics_share_dir else None
    app.state.frontend = FrontendState(
        config, engine, model_name, Metrics(model_name), served, load_api_keys(config),
        metrics_share=share, response_store=ResponseStore(config.responses_store_size),
    )  # fmt: skip
    app.add_exception_handler(APIError, _on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_error)
    app.include_router(info.health_router)  # probes need no key
    app.include_router(info.router, dependencies=[Depends(authorize)])
    metrics_guards = [] if config.metrics_without_auth else [Depends(authorize)]
    app.include_router(info.metrics_router, dependencies=metrics_guards)
    app.include_router(tokenize.router, dependencies=[Depends(admit)])
    if config.enable_tokenizer_info_endpoint:
        app.add_api_route(
            "/tokenizer_info",
            tokenize.tokenizer_info,
            methods=["GET"],
            dependencies=[Depends(authorize)],
            openapi_extra=openapi.errors(401, 503),
        )
    app.include_router(generate.router, dependencies=[Depends(admit)])
    app.include_router(responses.router, dependencies=[Depends(admit)])
    app.include_router(messages.router, dependencies=[Depends(admit)])
    app.include_router(responses.stored_router, dependencies=[Depends(authorize)])
    app.include_router(embeddings.router, dependencies=[Depends(admit)])
    if config.allow_runtime_lora_updating:
        app.include_router(lora.router, dependencies=[Depends(admit)])
    if config.enable_log_requests:
        app.add_middleware(RequestLog)
    return app


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return _in_the_routes_shape(request, exc)


async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route: 404, a wrong method: 405) in the API's shape."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    headers = dict(exc.headers) if exc.headers else None
    error = APIError(exc.status_code, str(exc.detail), kind, headers=headers)
    return _in_the_routes_shape(request, error)


async def _on_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error")
    return _in_the_routes_shape(request, APIError(500, f"internal error: {exc}", "internal_error"))


def _in_the_routes_shape(request: Request, error: APIError) -> JSONResponse:
    """OpenAI's error body, or Anthropic's on its routes (their SDK reads that one)."""
    if request.url.path.startswith("/v1/messages"):
        body = anthropic_error(error)
        return JSONResponse(body, status_code=error.status, headers=error.headers)
    return error.response()
