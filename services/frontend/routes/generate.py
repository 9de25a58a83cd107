"""/v1/completions and /v1/chat/completions: one flow, told apart by their Endpoint."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.frontend.api.endpoints import CHAT, COMPLETIONS, Endpoint
from services.frontend.api.openai_types import ChatCompletionRequest, CompletionRequest
from services.frontend.api.validation import plan_call
from services.frontend.routes import new_request_id
from services.frontend.routes.calls import APICall
from services.frontend.routes.openapi import json_body
from services.frontend.routes.state import AppState, FrontendState

router = APIRouter()
GENERATE_ERRORS = (400, 401, 404, 413, 429, 503, 504)  # documented, with the body types


@router.post(
    "/v1/completions", openapi_extra=json_body(CompletionRequest, GENERATE_ERRORS, stream=True)
)
async def completions(request: Request, state: AppState) -> Response:
    return await generate(request, state, COMPLETIONS)


@router.post(
    "/v1/chat/completions",
    openapi_extra=json_body(ChatCompletionRequest, GENERATE_ERRORS, stream=True),
)
async def chat_completions(request: Request, state: AppState) -> Response:
    return await generate(request, state, CHAT)


async def generate(request: Request, state: FrontendState, endpoint: Endpoint[Any]) -> Response:
    """Validate the body, run its sub-requests, answer with a stream or a body."""
    plan = plan_call(
        endpoint,
        request.state.body,
        state.served,
        new_request_id(endpoint.id_prefix),
        time.time(),
        state.engine.lora_adapters,
    )
    return await APICall(state.engine, state.metrics, plan, request).respond()
