"""The assembled app in-process (no `kvflow serve`, no engine processes): its guards, /health
while the engine starts, and the request log. The engine client is real, bound to an inproc
address that nothing else joins, so the engine stays "starting" unless a test says otherwise."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from services.frontend.app import create_app
from services.frontend.engine.client import EngineClient
from shared.config import Config, ConfigError
from shared.protocol import LoraAdapterInfo, LoraAdapterListing
from shared.version import VERSION
from tests.unit.snapshots import stats

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
_addresses = itertools.count()


App = tuple[TestClient, EngineClient]


def make_client(enable_log_requests: bool = False) -> Iterator[App]:
    settings = Config(
        frontend_address=f"inproc://frontend-{next(_addresses)}",
        api_key=KEY,
        max_request_body_bytes=1000,
        enable_log_requests=enable_log_requests,
    )
    engine = EngineClient(settings)
    try:
        yield TestClient(create_app(settings, engine, "test-model")), engine
    finally:
        engine.close()


@pytest.fixture
def app() -> Iterator[App]:
    yield from make_client()


@pytest.fixture
def logged_app() -> Iterator[App]:
    yield from make_client(enable_log_requests=True)


def ready_message(client: TestClient) -> str:
    response = client.get("/ready")
    assert response.status_code == 503
    return response.json()["error"]["message"]


def test_ready_says_starting_then_loading_then_ready_while_health_says_alive(app: App) -> None:
    client, engine = app
    assert ready_message(client) == (
        "the engine is unavailable: starting: waiting for scheduler, executor-0"
    )
    assert client.get("/health").status_code == 200  # starting is alive
    for component in engine.expected:
        engine.liveness.beat(component, time.monotonic())
    assert ready_message(client) == "the engine is unavailable: starting: loading the model"
    engine.snapshots[0], engine.snapshot_at[0] = stats(), time.monotonic()
    assert ready_message(client) == (
        "the engine is unavailable: starting: waiting for a tokenizer worker"
    )
    engine.tokenizers.beat("tokenizer-0", "s1", time.monotonic())
    assert client.get("/ready").status_code == 200
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models", headers=AUTH).json()
    assert models["data"][0]["max_model_len"] == 512
    assert models["data"][0]["id"] == "test-model"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/version"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/embeddings"),
    ],
)
def test_every_route_but_the_probes_needs_the_key(app: App, method: str, path: str) -> None:
    client, _ = app
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        response = client.request(method, path, headers=headers, json={})
        assert response.status_code == 401
        assert response.json()["error"] == {
            "message": "invalid or missing API key",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    assert client.get("/health").status_code == 200  # no key needed: they answer
    assert client.get("/ready").status_code == 503


def test_the_key_opens_the_routes(app: App) -> None:
    client, _ = app
    assert client.get("/version", headers=AUTH).json() == {"version": VERSION}
    assert "kvflow:request_success_total" in client.get("/metrics", headers=AUTH).text
    # Valid, but the engine is starting: 503, after validation (a bad body is still 400).
    response = client.post("/v1/completions", headers=AUTH, json={"prompt": "hi"})
    assert response.status_code == 503 and "starting" in response.json()["error"]["message"]
    response = client.post("/v1/completions", headers=AUTH, json={"prompt": "hi", "n": 0})
    assert (response.status_code, response.json()["error"]["param"]) == (400, "n")
    image = {"role": "user", "content": [{"type": "image_url"}]}
    response = client.post("/tokenize", headers=AUTH, json={"messages": [image]})
    assert (response.status_code, response.json()["error"]["param"]) == (400, "messages")


def test_draining_refuses_posts_only(app: App) -> None:
    client, _ = app
    client.app.state.frontend.draining = True
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        response = client.post(path, headers=AUTH, json={"prompt": "hi"})
        assert response.status_code == 503
        assert response.json()["error"]["message"] == (
            "the engine is unavailable: the server is shutting down"
        )
    assert client.get("/v1/models", headers=AUTH).status_code == 200
    assert ready_message(client) == "the engine is unavailable: draining"
    assert client.get("/health").status_code == 200  # draining is alive


def test_a_body_over_the_limit_is_413_declared_or_streamed(app: App) -> None:
    client, _ = app
    declared = client.post("/v1/completions", headers=AUTH, content=b"x" * 1001)
    assert declared.status_code == 413

    def chunks() -> Iterator[bytes]:  # no content-length: only the bytes read tell
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"y" * 100

    streamed = client.post("/v1/completions", headers=AUTH, content=chunks())
    assert streamed.status_code == 413
    assert streamed.json()["error"]["message"] == "the request body exceeds 1000 bytes"
    at_limit = client.post("/v1/completions", headers=AUTH, content=b" " * 1000)
    assert at_limit.status_code == 400  # read whole, then refused as JSON


def test_request_log_off_logs_nothing(app: App, caplog: pytest.LogCaptureFixture) -> None:
    client, _ = app
    with caplog.at_level(logging.INFO, logger="services.frontend"):
        client.get("/version", headers=AUTH)
        client.post("/v1/completions", headers=AUTH, json={"prompt": "hi"})
    assert [r for r in caplog.records if r.name == "services.frontend.metrics.request_log"] == []


def test_request_log_on_logs_one_line_per_api_request(
    logged_app: App, caplog: pytest.LogCaptureFixture
) -> None:
    client, _ = logged_app
    with caplog.at_level(logging.INFO, logger="services.frontend.metrics.request_log"):
        client.get("/health")
        client.get("/metrics", headers=AUTH)
        client.get("/version")
        client.post("/v1/chat/completions", headers=AUTH, json={"messages": []})
        client.post("/v1/completions", headers=AUTH, json={"prompt": "hi"})
    lines = [
        r.getMessage() for r in caplog.records if r.name == "services.frontend.metrics.request_log"
    ]
    assert len(lines) == 3, lines
    assert lines[0].startswith("GET /version request_id=- status=401 ")
    assert lines[1].startswith("POST /v1/chat/completions request_id=- status=400 ")
    assert lines[2].startswith("POST /v1/completions request_id=cmpl-")
    assert " status=503 prompt_tokens=0 completion_tokens=0 duration=" in lines[2]


def test_several_keys_from_the_flag_and_a_file_each_open_the_routes(tmp_path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# tenants\nsk-file-1\n\n  sk-file-2  \n")
    settings = Config(
        frontend_address=f"inproc://frontend-{next(_addresses)}",
        api_key="sk-a,sk-b",
        api_key_file=str(key_file),
    )
    engine = EngineClient(settings)
    try:
        client = TestClient(create_app(settings, engine, "test-model"))
        for key in ("sk-a", "sk-b", "sk-file-1", "sk-file-2"):
            headers = {"Authorization": f"Bearer {key}"}
            assert client.get("/version", headers=headers).status_code == 200
        for key in ("sk-c", "# tenants", "", "sk-a,sk-b"):
            headers = {"Authorization": f"Bearer {key}"}
            assert client.get("/version", headers=headers).status_code == 401
    finally:
        engine.close()


def test_a_missing_key_file_is_a_config_error(tmp_path) -> None:
    settings = Config(
        frontend_address=f"inproc://frontend-{next(_addresses)}",
        api_key_file=str(tmp_path / "nope"),
    )
    engine = EngineClient(settings)
    try:
        with pytest.raises(ConfigError, match="--api-key-file: cannot read"):
            create_app(settings, engine, "test-model")
    finally:
        engine.close()


def test_metrics_without_auth_opens_metrics_only() -> None:
    settings = Config(
        frontend_address=f"inproc://frontend-{next(_addresses)}",
        api_key=KEY,
        metrics_without_auth=True,
    )
    engine = EngineClient(settings)
    try:
        client = TestClient(create_app(settings, engine, "test-model"))
        assert client.get("/metrics").status_code == 200
        assert client.get("/v1/models").status_code == 401
    finally:
        engine.close()


def test_a_stalled_component_fails_health_and_ready(app: App) -> None:
    client, engine = app
    for component in engine.expected:
        engine.liveness.beat(component, time.monotonic())
    engine.snapshots[0], engine.snapshot_at[0] = stats(), time.monotonic()
    engine.stalled["executor-0"] = "step 9 has made no progress for 31 s"
    for probe in ("/health", "/ready"):
        response = client.get(probe)
        assert response.status_code == 503
        assert "executor-0 is stalled: step 9" in response.json()["error"]["message"]


def test_lora_adapters_are_listed_from_the_flag_and_loads_need_their_flag() -> None:
    """Before the scheduler's first word, /v1/models lists --lora-modules' adapters (parent:
    the served model, or the one given); the load routes exist only with
    --allow-runtime-lora-updating."""
    base = dict(api_key=KEY, enable_lora=True, lora_modules=("a=/loras/a",))
    for allowed in (False, True):
        settings = Config(
            frontend_address=f"inproc://frontend-{next(_addresses)}",
            allow_runtime_lora_updating=allowed,
            **base,  # type: ignore[arg-type]
        )
        engine = EngineClient(settings)
        try:
            client = TestClient(create_app(settings, engine, "test-model"))
            cards = client.get("/v1/models", headers=AUTH).json()["data"]
            assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
                ("test-model", None, "test-model"),
                ("a", "test-model", "/loras/a"),
            ]
            body = {"lora_name": "b", "lora_path": "/loras/b"}
            response = client.post("/v1/load_lora_adapter", json=body, headers=AUTH)
            # Allowed, the route asks the engine, which is still starting here.
            assert response.status_code == (503 if allowed else 404)
        finally:
            engine.close()


def test_an_adapter_a_replica_lost_is_not_named_and_must_be_unloaded_to_load_again() -> None:
    """Replica 1 lost "x" with its executor: /v1/models leaves it out, and a load of it says
    to unload it first (replica 0 still holds it)."""
    settings = Config(
        frontend_address=f"inproc://frontend-{next(_addresses)}",
        api_key=KEY,
        enable_lora=True,
        allow_runtime_lora_updating=True,
        data_parallel_size=2,
    )
    engine = EngineClient(settings)
    try:
        x = LoraAdapterInfo(name="x", lora_id=1, path="/x", parent="")
        engine.loras.take(LoraAdapterListing(replica=0, adapters=[x], version=1))
        engine.loras.take(LoraAdapterListing(replica=1, adapters=[], version=1))
        client = TestClient(create_app(settings, engine, "test-model"))
        cards = client.get("/v1/models", headers=AUTH).json()["data"]
        assert [card["id"] for card in cards] == ["test-model"]
        body = {"lora_name": "x", "lora_path": "/x"}
        response = client.post("/v1/load_lora_adapter", json=body, headers=AUTH)
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert "loaded already on engine replicas [0] alone" in message and "unload it" in message
    finally:
        engine.close()
