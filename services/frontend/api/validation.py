"""A generate call's body, validated: the sub-requests the engine runs (prompts x n) and what
the response needs. Pure: the request id and the arrival time are given, not drawn here."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from services.frontend.api.endpoints import CallPlan, Endpoint
from services.frontend.api.errors import APIError, bad_request
from services.frontend.api.limits import RequestLimits
from services.frontend.api.openai_types import decode_body
from shared.pooling import PoolingConfig
from shared.protocol import LoraAdapterInfo, ParameterError

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Served:
    """What the server serves and allows: the model's name, the limits, the longest run."""

    model: str
    limits: RequestLimits
    request_timeout: float | None = None
    pooling: PoolingConfig | None = None  # an embedding model's pooling; None: it generates


def plan_call(
    endpoint: Endpoint[Any],
    raw_body: bytes,
    served: Served,
    request_id: str,
    arrival_time: float,
    loras: Mapping[str, LoraAdapterInfo] | None = None,
) -> CallPlan:
    """Decode and validate a body; raise APIError (400 naming the parameter or the limit, 404
    for a model that is neither the served one nor one of its LoRA adapters `loras`) at the
    first problem, in the order a client would fix them."""
    if served.pooling is not None and not endpoint.read_embeds:
        raise bad_request(
            "this model serves embeddings only: use /v1/embeddings (or start with --task generate)",
            "model",
        )
    body = decode(raw_body, endpoint.body_type)
    model, lora_id = resolve_model(body.model, served.model, loras or {})
    try:
        inputs = endpoint.read(body)
        served.limits.check(inputs, endpoint.logprobs_param)
    except ParameterError as exc:
        raise bad_request(exc) from None
    samples = inputs.params.fan_out()  # n of them, each its own seed
    sub_requests = [
        prompt.request(
            f"{request_id}-{p * len(samples) + j}", params, arrival_time, inputs.priority
        )
        for p, prompt in enumerate(inputs.prompts)
        for j, params in enumerate(samples)
    ]
    if lora_id:
        sub_requests = [msgspec.structs.replace(r, lora_id=lora_id) for r in sub_requests]
    timeouts = [t for t in (inputs.timeout, served.request_timeout) if t is not None]
    return CallPlan(
        request_id=request_id,
        model=model,
        endpoint=endpoint,
        sub_requests=sub_requests,
        num_prompts=len(inputs.prompts),
        stream=body.stream,
        include_usage=body.include_usage,
        logprobs=inputs.logprobs,
        timeout=min(timeouts, default=None),
        context=inputs.context,
    )


def decode(raw_body: bytes, kind: type[T]) -> T:
    """A JSON body as `kind`; a 400 naming the field when it does not fit. Fields kvflow does
    not serve are ignored, as OpenAI's newer fields must be for clients that send them on every
    request, but not silently: a warning names each the first time it comes."""
    try:
        body = decode_body(raw_body, kind)
    except ParameterError as exc:
        raise bad_request(exc) from None
    _warn_of_ignored_fields(raw_body, kind)
    return body


_warned: set[tuple[str, str]] = set()  # (body type, field) already named in the log


def _warn_of_ignored_fields(raw_body: bytes, kind: type) -> None:
    keys = msgspec.json.decode(raw_body, type=dict[str, msgspec.Raw])  # values left unparsed
    known = _known_fields(kind)
    for name in sorted(keys.keys() - known):
        if (kind.__name__, name) not in _warned and len(_warned) < 1000:
            _warned.add((kind.__name__, name))
            logger.warning(
                "ignored a request field kvflow does not serve: %r (%s; said once per field)",
                name,
                kind.__name__,
            )


@functools.cache
def _known_fields(kind: type) -> frozenset[str]:
    return frozenset(f.encode_name for f in msgspec.structs.fields(kind))


def resolve_model(
    requested: str | None, served: str, loras: Mapping[str, LoraAdapterInfo]
) -> tuple[str, int]:
    """The model a request names and its LoRA adapter id (0: the served model itself, which
    no model named means too); 404 for any other name."""
    if requested is None or requested == served:
        return served, 0
    adapter = loras.get(requested)
    if adapter is None:
        raise model_not_found(requested)
    return requested, adapter.lora_id


def model_not_found(requested: str) -> APIError:
    return APIError(
        404,
        f"The model `{requested}` does not exist.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )
