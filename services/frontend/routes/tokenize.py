"""/tokenize (text or messages -> token ids) and /detokenize (token ids -> text), answered by
the tokenizer pool."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.frontend.api.errors import bad_request
from services.frontend.api.openai_types import DetokenizeBody, TokenizeBody, template_kwargs
from services.frontend.api.structured import tool_definition
from services.frontend.api.validation import decode
from services.frontend.routes import engine_answer, new_request_id
from services.frontend.routes.openapi import json_body
from services.frontend.routes.state import AppState, FrontendState
from shared.protocol import ParameterError, TokenizeRequest, TokenizeResult

router = APIRouter()
TOKENIZE_ERRORS = (400, 401, 413, 503)  # documented, with the body types


@router.post("/tokenize", openapi_extra=json_body(TokenizeBody, TOKENIZE_ERRORS))
async def tokenize(request: Request, state: AppState) -> dict[str, Any]:
    body = decode(request.state.body, TokenizeBody)
    try:
        messages = body.chat_messages()
        tools = None if body.tools is None else [tool_definition(t) for t in body.tools]
        kwargs = template_kwargs(body.chat_template_kwargs)
    except ParameterError as exc:
        raise bad_request(exc) from None
    result = await _ask_pool(
        request,
        state,
        TokenizeRequest(
            request_id=new_request_id("tok"),
            prompt=body.prompt,
            messages=messages,
            add_special_tokens=body.add_special_tokens,
            tools=tools,
            chat_template_kwargs=kwargs,
        ),
    )
    return {
        "count": len(result.token_ids),
        "max_model_len": state.max_model_len,
        "tokens": result.token_ids,
    }


@router.post("/detokenize", openapi_extra=json_body(DetokenizeBody, TOKENIZE_ERRORS))
async def detokenize(request: Request, state: AppState) -> dict[str, Any]:
    try:
        token_ids = decode(request.state.body, DetokenizeBody).token_ids()
    except ParameterError as exc:
        raise bad_request(exc) from None
    result = await _ask_pool(
        request, state, TokenizeRequest(request_id=new_request_id("tok"), token_ids=token_ids)
    )
    return {"prompt": result.text}


async def tokenizer_info(request: Request, state: AppState) -> Response:
    """GET /tokenizer_info (mounted with --enable-tokenizer-info-endpoint)."""
    asked = TokenizeRequest(request_id=new_request_id("tok"), info=True)
    result = await _ask_pool(request, state, asked)
    return Response(result.text, media_type="application/json")


async def _ask_pool(
    request: Request, state: FrontendState, tokenize_request: TokenizeRequest
) -> TokenizeResult:
    asked = state.engine.tokenize(tokenize_request)
    return await engine_answer(request, tokenize_request.request_id, asked)
