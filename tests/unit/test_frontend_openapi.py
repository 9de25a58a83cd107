"""The OpenAPI document: behind the key, no /docs, and request bodies that are the msgspec body
types' own JSON Schemas (so the document follows the code, and tests/e2e/test_http_fuzz.py
fuzzes what the routes really decode)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import jsonschema
import msgspec
import pytest
from fastapi.testclient import TestClient

from services.frontend.api.embeddings import EmbeddingRequest
from services.frontend.api.errors import APIError, queue_full
from services.frontend.api.messages_request import CountTokensRequest, MessagesRequest
from services.frontend.api.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    TokenizeBody,
)
from services.frontend.api.responses_request import ResponsesRequest
from services.frontend.app import create_app
from services.frontend.engine.client import EngineClient
from services.frontend.routes.openapi import ErrorBody
from shared.config import Config

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODIES = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeBody,
    "/detokenize": DetokenizeBody,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
}
_addresses = itertools.count()


@pytest.fixture
def client() -> Iterator[TestClient]:
    settings = Config(frontend_address=f"inproc://openapi-{next(_addresses)}", api_key=KEY)
    engine = EngineClient(settings)
    try:
        yield TestClient(create_app(settings, engine, "test-model"))
    finally:
        engine.close()


@pytest.fixture
def document(client: TestClient) -> dict[str, Any]:
    response = client.get("/openapi.json", headers=AUTH)
    assert response.status_code == 200
    return response.json()


def resolve(document: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/components/schemas/")
    return document["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_the_document_needs_the_key_and_there_is_no_docs_page(client: TestClient) -> None:
    assert client.get("/openapi.json").status_code == 401
    assert client.get("/openapi.json", headers={"Authorization": "Bearer nope"}).status_code == 401
    for page in ("/docs", "/redoc"):
        assert client.get(page, headers=AUTH).status_code == 404


def test_each_post_route_documents_its_body_type_s_own_schema(document: dict[str, Any]) -> None:
    posts = {path for path, item in document["paths"].items() if "post" in item}
    assert posts == BODIES.keys()
    for path, body_type in BODIES.items():
        request_body = document["paths"][path]["post"]["requestBody"]
        assert request_body["required"] is True
        ref = request_body["content"]["application/json"]["schema"]["$ref"]
        (expected_ref,), components = msgspec.json.schema_components(
            [body_type], ref_template="#/components/schemas/{name}"
        )
        assert ref == expected_ref["$ref"]
        for name, schema in components.items():  # nested types too (Message, ContentPart...)
            assert document["components"]["schemas"][name] == schema
            jsonschema.Draft202012Validator.check_schema(schema)


def test_every_ref_in_the_document_resolves(document: dict[str, Any]) -> None:
    def refs(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            yield from ([node["$ref"]] if "$ref" in node else [])
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    found = list(refs(document))
    assert len(found) > len(BODIES)
    for ref in found:
        assert resolve(document, ref)


def test_error_answers_are_documented_as_the_bodies_api_error_writes(
    document: dict[str, Any],
) -> None:
    completions = document["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "401", "404", "413", "429", "503", "504"} <= completions.keys()
    ref = completions["400"]["content"]["application/json"]["schema"]["$ref"]
    assert resolve(document, ref)["title"] == "ErrorBody"
    for error in (APIError(400, "bad", "invalid_request_error", "n"), queue_full("full")):
        msgspec.convert(error.body(), ErrorBody)  # raises if the shapes drift apart
    streamed = completions["200"]["content"]
    assert {"application/json", "text/event-stream"} <= streamed.keys()


def test_probes_and_metrics_document_what_they_return(document: dict[str, Any]) -> None:
    for probe in ("/health", "/ready"):
        responses = document["paths"][probe]["get"]["responses"]
        assert "content" not in responses["200"]  # an empty body
        assert "503" in responses
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]
    assert list(metrics["content"]) == ["text/plain"]
