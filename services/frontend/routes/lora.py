"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --allow-runtime-lora-updating,
behind the API key), carried out on every engine replica by a tokenizer worker
(services/tokenizer/lora_fanout.py) and answered once every replica's executor has read and
checked a new adapter. An adapter loaded is named by requests as their `model`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from services.frontend.api.errors import bad_request
from services.frontend.api.openai_types import LoadLoraAdapterBody, UnloadLoraAdapterBody
from services.frontend.api.validation import decode
from services.frontend.routes import engine_answer, new_request_id
from services.frontend.routes.openapi import json_body
from services.frontend.routes.state import AppState, FrontendState
from shared.protocol import LoraAdapterRequest

router = APIRouter()
LORA_ERRORS = (400, 401, 404, 503)


@router.post("/v1/load_lora_adapter", openapi_extra=json_body(LoadLoraAdapterBody, LORA_ERRORS))
async def load_lora_adapter(request: Request, state: AppState) -> PlainTextResponse:
    body = decode(request.state.body, LoadLoraAdapterBody)
    if body.lora_name == state.model_name:
        raise bad_request(f"{body.lora_name!r} is the served model's name", "lora_name")
    holders = state.engine.loras.holders(body.lora_name)
    if holders and body.lora_name not in state.engine.lora_adapters:
        # A load or unload of it half way through the replicas, or the others lost it with
        # their executors (their schedulers logged it): replica 0 would refuse it unexplained.
        raise bad_request(
            f"a LoRA adapter named {body.lora_name!r} is loaded already on engine replicas "
            f"{holders} alone: a load or unload of it is under way, or the other replicas lost"
            " it with their executors (then unload it and load it again)",
            "lora_name",
        )
    await _ask(request, state, "load", body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", openapi_extra=json_body(UnloadLoraAdapterBody, LORA_ERRORS))
async def unload_lora_adapter(request: Request, state: AppState) -> PlainTextResponse:
    body = decode(request.state.body, UnloadLoraAdapterBody)
    known = state.engine.lora_adapters.get(body.lora_name)
    if body.lora_int_id is not None and known is not None and known.lora_id != body.lora_int_id:
        raise bad_request(
            f"the adapter {body.lora_name!r} has id {known.lora_id}, not {body.lora_int_id}",
            "lora_int_id",
        )
    await _ask(request, state, "unload", body.lora_name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _ask(
    request: Request, state: FrontendState, action: str, name: str, path: str | None
) -> None:
    message = LoraAdapterRequest(
        request_id=new_request_id("lora"), action=action, lora_name=name, lora_path=path
    )
    await engine_answer(request, message.request_id, state.engine.lora_adapter(message))
