"""What the server is and how it is: /health (for probes, no key), /version, /v1/models,
/metrics (Prometheus)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from services.frontend.errors import unavailable
from services.frontend.state import AppState
from shared.version import VERSION

health_router = APIRouter()
router = APIRouter()


@health_router.get("/health")
async def health(state: AppState) -> Response:
    reason = "draining" if state.draining else state.engine.unavailable_reason()
    if reason is None:
        return Response(status_code=200)
    return unavailable(reason).response()


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": VERSION}


@router.get("/v1/models")
async def models(state: AppState) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "kvflow",
                "root": state.model_name,
                "max_model_len": state.max_model_len,
            }
        ],
    }


@router.get("/metrics")
async def prometheus(state: AppState) -> PlainTextResponse:
    text = state.metrics.render(
        state.engine.stats, len(state.engine.tokenizers.accepting), len(state.engine.queues)
    )
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
