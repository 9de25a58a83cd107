"""/v1/embeddings as data: its body, how it is read into the one generate flow (one embed
sub-request per input, validation.py and calls.py), and its OpenAI-shaped answer.

An embedding is the engine's one output of an `embed` request (shared/pooling.py says how the
model pools); `dimensions` shortens it here, at the edge, and `encoding_format` spells it.
"""

from __future__ import annotations

import base64
import dataclasses
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from services.frontend.api import responses as r
from services.frontend.api.endpoints import CallPlan, Endpoint, Inputs, Prompt
from services.frontend.api.errors import APIError, bad_request
from services.frontend.api.openai_types import Int64, PromptValue, read_prompts
from services.frontend.api.sse import StreamWriter
from services.frontend.api.validation import Served, plan_call
from shared.pooling import PoolingConfig, check_dimensions, shorten
from shared.protocol import LoraAdapterInfo, ParameterError, SamplingParams


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """OpenAI's embeddings body (`user` is taken and ignored, as vLLM does)."""

    input: PromptValue = None  # a text, texts, token ids, or lists of token ids
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None  # shorter vectors, where the model allows them
    user: str | None = None
    priority: Int64 = 0  # vLLM's: with --scheduling-policy priority, lower runs first

    # What the generate flow reads of every body: an embedding call never streams.
    stream = False
    include_usage = False


def _read(body: EmbeddingRequest) -> Inputs:
    prompts = read_prompts(body.input, "input")
    params = SamplingParams(embed=True, max_tokens=1, temperature=0.0)
    return Inputs(
        prompts=[Prompt(text=p) if isinstance(p, str) else Prompt(token_ids=p) for p in prompts],
        params=params,
        logprobs=False,
        priority=body.priority,
        context=EmbeddingContext(body.encoding_format, body.dimensions),
    )


def _vector(values: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return values
    # OpenAI's base64: the little-endian float32 bytes of the vector.
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


@dataclass(frozen=True)
class EmbeddingContext:
    """What the answer repeats of the body, and how the model's vectors may be shortened."""

    encoding_format: str
    dimensions: int | None
    pooling: PoolingConfig = field(default_factory=PoolingConfig)  # set by plan_embeddings


def embeddings_body(plan: CallPlan, choices: list[r.Choice]) -> dict[str, Any]:
    """The response: one embedding per input, in input order, and the prompts' token counts."""
    context: EmbeddingContext = plan.context
    data = []
    for choice in choices:
        if choice.embedding is None:  # ended without one (an abort): no answer to give
            message = f"input {choice.index} ended without its embedding"
            raise APIError(500, message, "internal_error")
        vector = shorten(choice.embedding, context.dimensions, context.pooling)
        encoded = _vector(vector, context.encoding_format)
        data.append({"object": "embedding", "index": choice.index, "embedding": encoded})
    num_tokens = sum(c.num_prompt_tokens for c in choices)
    return {
        "object": "list",
        "id": plan.request_id,
        "data": data,
        "model": plan.model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


def _no_stream(plan: CallPlan) -> StreamWriter:
    raise AssertionError("an embeddings call never streams")


EMBEDDINGS = Endpoint(
    body_type=EmbeddingRequest,
    read=_read,
    logprobs_param="logprobs",
    id_prefix="embd",
    response_body=embeddings_body,
    stream_writer=_no_stream,
    read_embeds=True,
)


def plan_embeddings(
    raw_body: bytes,
    served: Served,
    request_id: str,
    arrival_time: float,
    loras: Mapping[str, LoraAdapterInfo] | None = None,
) -> CallPlan:
    """Validate an embeddings body (400 naming the field; 400 for a model that does not embed)
    and plan its sub-requests, one per input."""
    if served.pooling is None:
        raise bad_request(
            "this model generates text and has no embeddings (serve an embedding model, or "
            "start with --task embed)",
            "model",
        )
    plan = plan_call(EMBEDDINGS, raw_body, served, request_id, arrival_time, loras)
    context = dataclasses.replace(plan.context, pooling=served.pooling)
    try:
        check_dimensions(context.dimensions, served.pooling)
    except ParameterError as exc:
        raise bad_request(exc) from None
    return dataclasses.replace(plan, context=context)
