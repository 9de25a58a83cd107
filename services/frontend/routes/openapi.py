"""The OpenAPI document's request and error bodies, as the msgspec types' own JSON Schemas.

The POST routes take the raw `Request` and decode its body with msgspec themselves, so FastAPI
sees no body to describe. Each such route names its body type with `json_body(...)` in its
`openapi_extra`, with the error statuses it answers (`errors(...)` for the other routes);
`install` then adds the JSON Schema of every named type (and of the types they nest) to the
document's `components/schemas`, so the document follows the code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import FastAPI

_REF = "#/components/schemas/{name}"
# One event of a stream (OpenAPI 3.1 reads an event stream's schema as each event's).
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string", "description": "a chunk as JSON, or [DONE]"}},
    "required": ["data"],
}


class ErrorDetail(msgspec.Struct):
    """The `error` of an error body, as `errors.APIError.body()` writes it."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct):
    """Every 4xx and 5xx answer's body (OpenAI's shape)."""

    error: ErrorDetail


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicErrorBody(msgspec.Struct):
    """The error bodies of Anthropic's routes (/v1/messages), in its shape."""

    type: str
    error: AnthropicErrorDetail


_ERROR_STATUSES = {
    400: "Invalid request: a parameter (named in `error.param`) or a limit",
    401: "Invalid or missing API key",
    404: "The model named is not served",
    413: "The body exceeds --max-request-body-bytes",
    429: "The waiting queue is full; retry after `Retry-After` seconds",
    503: "The engine is starting, draining or has failed",
    504: "The request ran past its `timeout` or --request-timeout",
}

# Every type a route's document names, by schema name; install() describes them all. Filled
# as the route modules are imported, which is before any app is built.
_types: dict[str, type[msgspec.Struct]] = {"ErrorBody": ErrorBody}


def json_body(
    body_type: type[msgspec.Struct],
    statuses: tuple[int, ...],
    stream: bool = False,
    error_body: type[msgspec.Struct] = ErrorBody,
) -> dict[str, Any]:
    """A POST route's `openapi_extra`: its required JSON body, a `body_type`, and the error
    statuses it answers with an `error_body`; `stream`: 200 may also be an SSE stream."""
    extra = errors(*statuses, error_body=error_body)
    extra["requestBody"] = {"required": True, "content": _json(_ref(body_type))}
    if stream:
        extra["responses"]["200"] = {"content": {"text/event-stream": {"schema": _SSE_EVENT}}}
    return extra


def errors(*statuses: int, error_body: type[msgspec.Struct] = ErrorBody) -> dict[str, Any]:
    """A route's `openapi_extra`: the error statuses it answers, each with an `error_body`."""
    return {
        "responses": {
            str(status): {
                "description": _ERROR_STATUSES[status],
                "content": _json(_ref(error_body)),
            }
            for status in statuses
        }
    }


def _ref(struct: type[msgspec.Struct]) -> dict[str, str]:
    (ref,), _ = msgspec.json.schema_components([struct], ref_template=_REF)
    _types[ref["$ref"].rsplit("/", 1)[1]] = struct
    return ref


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def component_schemas() -> dict[str, Any]:
    """`components/schemas` for every type named so far, and the types they nest."""
    _, components = msgspec.json.schema_components(list(_types.values()), ref_template=_REF)
    return components


def install(app: FastAPI) -> None:
    """Make `app.openapi()` add the schemas of the named types to the document FastAPI builds."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        document = build()  # FastAPI's, cached until the routes change
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        if not _types.keys() <= schemas.keys():
            schemas.update(component_schemas())
        return document

    app.openapi = openapi  # type: ignore[method-assign]
