"""What the server is and how it is: /health and /ready (for probes, no key), /version,
/v1/models, /openapi.json, /metrics (Prometheus).

/health is liveness: 503 only when the engine has failed (a component dead, silent or stuck),
so a supervisor restarts it; 200 while it starts and while it drains. /ready is readiness: 200
only while new requests are taken, 503 with the reason ("starting: ...", "draining", a
failure) otherwise. Both answer from what the frontend has heard, with no engine round trip.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from services.frontend.api.errors import unavailable
from services.frontend.api.validation import model_not_found
from services.frontend.routes.openapi import errors
from services.frontend.routes.state import AppState
from shared.version import VERSION

health_router = APIRouter()
router = APIRouter()
metrics_router = APIRouter()  # behind the key unless --metrics-without-auth


# response_class and openapi_extra only document what the routes return.
PROBE_DOC: dict[str, Any] = {"response_class": Response, "openapi_extra": errors(503)}


@health_router.get("/health", **PROBE_DOC)
async def health(state: AppState) -> Response:
    return _probe(state.engine.failure_reason())


@health_router.get("/ready", **PROBE_DOC)
async def ready(state: AppState) -> Response:
    return _probe(state.not_ready_reason())


def _probe(reason: str | None) -> Response:
    if reason is None:
        return Response(status_code=200)
    return unavailable(reason).response()


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": VERSION}


@router.get("/v1/models")
async def models(state: AppState) -> dict[str, Any]:
    """The served model, then its LoRA adapters (each with its `parent`)."""
    cards = [_model_card(state), *(_model_card(state, name) for name in state.engine.lora_adapters)]
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model_id:path}", openapi_extra=errors(404))
async def model(model_id: str, state: AppState) -> dict[str, Any]:
    """One model's card; ids may hold slashes ("org/name"), as Hugging Face names do."""
    if model_id == state.model_name:
        return _model_card(state)
    if model_id in state.engine.lora_adapters:
        return _model_card(state, model_id)
    raise model_not_found(model_id)


def _model_card(state: AppState, lora_name: str | None = None) -> dict[str, Any]:
    card = {
        "id": state.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "kvflow",
        "root": state.model_name,
        "parent": None,
        "max_model_len": state.max_model_len,
    }
    adapter = state.engine.lora_adapters.get(lora_name) if lora_name else None
    if adapter is not None:
        parent = adapter.parent or state.model_name
        card |= {"id": adapter.name, "root": adapter.path, "parent": parent}
    return card


@router.get("/openapi.json", include_in_schema=False)
async def openapi_document(request: Request) -> JSONResponse:
    """The API's OpenAPI document: behind the key like /v1/models, as it lists what the server
    takes. There is no /docs: its page would fetch this without the key, from a CDN's scripts."""
    return JSONResponse(request.app.openapi())


@metrics_router.get("/metrics", response_class=PlainTextResponse)
async def prometheus(state: AppState) -> PlainTextResponse:
    engine = state.engine
    snapshots = [engine.snapshots[r] for r in sorted(engine.snapshots)]
    metrics, in_flight = state.metrics, len(engine.queues)
    if state.metrics_share is not None:  # frontends side by side: this one counts them all
        peers = state.metrics_share.peers()
        metrics = metrics.merged(peers)
        in_flight += sum(peer.in_flight for peer in peers)
    text = metrics.render(snapshots, len(engine.tokenizers.accepting), in_flight)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
