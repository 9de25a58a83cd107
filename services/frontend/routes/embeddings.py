"""/v1/embeddings: the generate flow of routes/generate.py, one embed request per input."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.frontend.api.embeddings import EMBEDDINGS, EmbeddingRequest, plan_embeddings
from services.frontend.routes import new_request_id
from services.frontend.routes.calls import APICall
from services.frontend.routes.openapi import json_body
from services.frontend.routes.state import AppState

router = APIRouter()
EMBEDDING_ERRORS = (400, 401, 404, 413, 429, 503, 504)


@router.post("/v1/embeddings", openapi_extra=json_body(EmbeddingRequest, EMBEDDING_ERRORS))
async def embeddings(request: Request, state: AppState) -> Response:
    plan = plan_embeddings(
        request.state.body,
        state.served,
        new_request_id(EMBEDDINGS.id_prefix),
        time.time(),
        state.engine.lora_adapters,
    )
    return await APICall(state.engine, state.metrics, plan, request).respond()
