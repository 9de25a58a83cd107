"""OpenAI's Responses API: `POST /v1/responses` through the one generate flow, and the
responses this frontend keeps (`GET`, `DELETE /v1/responses/{id}`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.frontend.api.responses_endpoint import response_not_found, responses_endpoint
from services.frontend.api.responses_request import ResponsesRequest
from services.frontend.routes.generate import GENERATE_ERRORS, generate
from services.frontend.routes.openapi import errors, json_body
from services.frontend.routes.state import AppState

router = APIRouter()  # behind admission, as the other generate routes
stored_router = APIRouter()  # behind the API key only


@router.post(
    "/v1/responses", openapi_extra=json_body(ResponsesRequest, GENERATE_ERRORS, stream=True)
)
async def create_response(request: Request, state: AppState) -> Response:
    endpoint = responses_endpoint(state.response_store)
    return await generate(request, state, endpoint)


@stored_router.get("/v1/responses/{response_id}", openapi_extra=errors(404))
async def get_response(response_id: str, state: AppState) -> dict[str, Any]:
    response = state.response_store.response(response_id)
    if response is None:
        raise response_not_found(response_id)
    return response


@stored_router.delete("/v1/responses/{response_id}", openapi_extra=errors(404))
async def delete_response(response_id: str, state: AppState) -> dict[str, Any]:
    if not state.response_store.delete(response_id):
        raise response_not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
