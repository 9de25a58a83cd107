"""Anthropic's Messages API: `POST /v1/messages` through the one generate flow, and
`POST /v1/messages/count_tokens` through the tokenizer pool. Errors on these routes take
Anthropic's shape (app.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.frontend.api.errors import bad_request
from services.frontend.api.messages_endpoint import MESSAGES
from services.frontend.api.messages_request import (
    CountTokensRequest,
    chat_messages,
    chat_tools,
)
from services.frontend.api.openai_types import chat_message
from services.frontend.api.structured import tool_definition
from services.frontend.api.validation import decode, resolve_model
from services.frontend.routes import engine_answer, new_request_id
from services.frontend.routes.generate import GENERATE_ERRORS, generate
from services.frontend.routes.openapi import AnthropicErrorBody, json_body
from services.frontend.routes.state import AppState
from shared.protocol import ParameterError, TokenizeRequest

router = APIRouter()


@router.post(
    "/v1/messages",
    openapi_extra=json_body(
        MESSAGES.body_type, GENERATE_ERRORS, stream=True, error_body=AnthropicErrorBody
    ),
)
async def create_message(request: Request, state: AppState) -> Response:
    return await generate(request, state, MESSAGES)


@router.post(
    "/v1/messages/count_tokens",
    openapi_extra=json_body(
        CountTokensRequest, (400, 401, 404, 413, 503), error_body=AnthropicErrorBody
    ),
)
async def count_tokens(request: Request, state: AppState) -> dict[str, Any]:
    """The prompt's tokens, as the chat template renders the messages, system and tools."""
    body = decode(request.state.body, CountTokensRequest)
    resolve_model(body.model, state.model_name, state.engine.lora_adapters)
    try:
        messages = [chat_message(m) for m in chat_messages(body.system, body.messages)]
        tools = [tool_definition(t) for t in chat_tools(body.tools) or []] or None
    except ParameterError as exc:
        raise bad_request(exc) from None
    asked = TokenizeRequest(request_id=new_request_id("tok"), messages=messages, tools=tools)
    result = await engine_answer(request, asked.request_id, state.engine.tokenize(asked))
    return {"input_tokens": len(result.token_ids)}
