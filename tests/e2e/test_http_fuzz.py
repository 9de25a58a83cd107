"""Fuzzing the HTTP API from its own OpenAPI document: no input gets a 5xx or hangs.

One real `kvflow serve` (with an API key) serves `/openapi.json`, whose request bodies are
generated from the msgspec types the routes decode (`services/frontend/routes/openapi.py`).
schemathesis loads that document from the running server and sends every operation its
coverage cases (boundary values, wrong types, missing fields, other methods) and a bounded
number of random examples, valid by the document (positive) and not (negative). Each answer
must be:

- no server error: no 5xx, except a 504 `request_timeout` for a body that set its own
  `timeout` (documented: a deadline that a client asks for and gets);
- on time: every request has a generous timeout, a guard against hangs only;
- a refusal (4xx) for data the document rules out, with a status, a media type and an error
  body that the document declares.

The document says what the types allow. So that valid data reaches the engine (not only the
frontend's checks), the test narrows it first with what the frontend checks beyond the types
(`narrow`): the served model, chat roles, numeric ranges, this server's limits; and negative
data then probes each of those checks.

Afterwards the server still runs, is healthy and ready, holds no request and no KV block, and
the official `openai` client gets a normal completion.

Generation is kept cheap on 2 CPU cores: the server runs a tiny random model with SmolLM2's
tokenizer (tests/tool_chat_model.py), refuses `max_tokens` > 2, n > 4 and more
than 4 prompts (400s, which fuzzing checks too), and a generate body that sets no token limit
is sent with `max_tokens` 2 (`bound_generation`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis.checks import CheckContext
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.e2e.server import Server, start_server

# Random examples per operation (the coverage cases come on top); more for a longer hunt. 10
# keeps the run of nine operations within the suite's budget on 2 cores.
MAX_EXAMPLES = int(os.environ.get("KVFLOW_HTTP_FUZZ_EXAMPLES", "10"))
REQUEST_TIMEOUT_S = 120.0  # a hang guard: the slowest answer here takes seconds
MAX_TOKENS, MAX_N, MAX_PROMPTS, MAX_LOGPROBS = 2, 4, 4, 20
SERVER_FLAGS = (
    *("--max-tokens-limit", str(MAX_TOKENS), "--max-n", str(MAX_N)),
    *("--max-num-prompts", str(MAX_PROMPTS), "--max-logprobs", str(MAX_LOGPROBS)),
)
DEFAULT_MAX_TOKENS = MAX_TOKENS  # for a generate body that sets none
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")

# What the frontend allows beyond the body types (SamplingParams.validate, the limits above),
# by field, for the numeric branch of each field's schema.
BOUNDS: dict[str, dict[str, float]] = {
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},  # -1 and 0 keep every token
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "n": {"minimum": 1, "maximum": MAX_N},
    "max_tokens": {"minimum": 1, "maximum": MAX_TOKENS},
    "max_completion_tokens": {"minimum": 1, "maximum": MAX_TOKENS},
    "min_tokens": {"minimum": 0},
    "logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},  # completions' (chat's is a bool)
    "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "timeout": {"exclusiveMinimum": 0},
    "priority": {"minimum": 0, "maximum": 0},  # other priorities need --scheduling-policy
}
REFUSED = ("suffix", "chat_template")  # taken only when absent or null
CHAT_ROLES = ["system", "user", "assistant", "developer"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tool_chat_model_dir: Path) -> Iterator[Server]:
    # A tiny random model with SmolLM2's tokenizer and a chat template: what is fuzzed is the
    # API, and its generations cost a fraction of SmolLM2's on 2 cores.
    server = start_server(str(tool_chat_model_dir), *SERVER_FLAGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(server: Server) -> schemathesis.BaseSchema:
    response = httpx.get(f"{server.url}/openapi.json", headers=server.headers(), timeout=30)
    response.raise_for_status()
    model = server.client().models.list().data[0].id
    config = schemathesis.Config.from_dict(
        {
            "base-url": server.url,
            "headers": server.headers(),
            "request-timeout": REQUEST_TIMEOUT_S,
            "generation": {"mode": "all", "max-examples": MAX_EXAMPLES},
            "suppress-health-check": ["all"],
        }
    )
    return schemathesis.openapi.from_dict(narrow(response.json(), model), config=config)


def narrow(document: dict[str, Any], model: str) -> dict[str, Any]:
    """The served document, narrowed to what the frontend takes beyond the body types."""
    document = copy.deepcopy(document)
    schemas = document["components"]["schemas"]
    schemas["CompletionRequest"]["required"] = ["prompt"]  # optional to msgspec, not to prompts()
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        fields = schemas[name]["properties"]
        fields["model"] = {"enum": [model, None]}
        for field, bounds in BOUNDS.items():
            if field in fields:
                for branch in fields[field].get("anyOf", [fields[field]]):
                    if branch.get("type") in ("integer", "number"):
                        branch.update(bounds)
        for field in set(REFUSED) & fields.keys():
            fields[field] = {"type": "null"}
    # Chat takes four roles; /tokenize, which shares Message, takes any.
    chat_message = copy.deepcopy(schemas["Message"])
    chat_message["properties"]["role"] = {"enum": CHAT_ROLES}
    schemas["ChatMessage"] = chat_message
    chat_messages = schemas["ChatCompletionRequest"]["properties"]["messages"]
    chat_messages.update(items={"$ref": "#/components/schemas/ChatMessage"}, minItems=1)
    schemas["ContentPart"]["properties"]["type"] = {"enum": ["text"]}
    return document


def bound_generation(case: schemathesis.Case) -> None:
    """A generate body that sets no token limit gets the server's: without, completions ask
    for 16 tokens (refused here) and chat (or completions' explicit null) runs to the end of the
    context, which would take minutes on 2 CPU cores."""
    body = case.body
    if not isinstance(body, dict):
        return
    if case.path == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = DEFAULT_MAX_TOKENS  # (Messages requires its max_tokens)
    if case.path not in GENERATE_PATHS:
        return
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = DEFAULT_MAX_TOKENS


@schemathesis.check
def no_server_error(
    ctx: CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> bool | None:
    """No 5xx, but for the deadline a body asked for: a 504 `request_timeout`."""
    asked_deadline = isinstance(case.body, dict) and case.body.get("timeout") is not None
    if response.status_code == 504 and asked_deadline:
        assert response.json()["error"]["code"] == "request_timeout", response.text
        return None
    assert response.status_code < 500, f"{response.status_code}: {response.text[:2000]}"
    return None


CHECKS = [
    no_server_error,
    negative_data_rejection,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture
def string_node_id(request: pytest.FixtureRequest) -> None:
    """The test item's `_nodeid`, which schemathesis (4.32) reads and rewrites for each operation
    of a schema loaded from a fixture: pytest 9.2 keeps a node's id elsewhere (a structured
    `_id`), and without this each fuzzed test fails at its start with an AttributeError. On a
    pytest that has the attribute nothing changes; on one that has not, the item keeps its own
    id in reports and a failure names its operation by the subtest's label."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


@schema.parametrize()
@pytest.mark.usefixtures("string_node_id")
def test_every_operation_answers_fuzzed_input_without_5xx_or_hang(
    case: schemathesis.Case, server: Server
) -> None:
    bound_generation(case)
    response = case.call(headers=server.headers(), timeout=REQUEST_TIMEOUT_S)
    case.validate_response(response, checks=CHECKS, headers=server.headers())


def test_the_server_serves_normally_after_the_fuzzing(server: Server) -> None:
    assert server.proc.poll() is None
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
    idle = server.wait_idle(timeout=30)
    assert (idle["num_requests_running"], idle["num_requests_waiting"]) == (0, 0)
    assert idle["kv_cache_usage_perc"] == 0
    client = server.client(timeout=60)
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.choices[0].text and out.usage.completion_tokens == MAX_TOKENS
