"""The OpenAI API of a real `kvflow serve`, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from kvflow import LLM, SamplingParams
from tests.e2e.server import Server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:"]


@pytest.fixture(scope="module")
def server(default_server: Server) -> Server:
    return default_server  # shared with other modules (tests/e2e/conftest.py)


@pytest.fixture(scope="module")
def model(server: Server) -> str:
    return server.client().models.list().data[0].id


def test_greedy_completions_equal_offline_generate(server: Server, model: str, smollm2: LLM):
    client = server.client()
    offline = smollm2.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    batch = client.completions.create(model=model, prompt=PROMPTS, max_tokens=24, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [
        r.text for r in offline
    ]
    assert batch.usage.completion_tokens == sum(len(r.token_ids) for r in offline)
    for prompt, expected in zip(PROMPTS, offline, strict=True):
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream) == expected.text


def test_token_id_prompts_and_echo(server: Server, model: str) -> None:
    client = server.client()
    tokens = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "Hello there"}, headers=server.headers()
    ).json()["tokens"]
    out = client.completions.create(
        model=model, prompt=tokens, max_tokens=4, temperature=0, echo=True
    )
    assert out.choices[0].text.startswith("Hello there")


def test_chat_streamed_and_not(server: Server, model: str) -> None:
    client = server.client()
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    full = client.chat.completions.create(
        model=model, messages=messages, max_tokens=20, temperature=0
    )
    assert "Paris" in full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        full.choices[0].message.content
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_n_stop_and_logprobs(server: Server, model: str) -> None:
    client = server.client()
    two = client.completions.create(
        model=model, prompt="Once upon a time", n=2, max_tokens=12, temperature=1.0, seed=3
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.choices[0].text != two.choices[1].text
    stopped = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=16, temperature=0, stop=["."]
    )
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (" Paris", "stop")
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 5
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
    assert "".join(e.token for e in entries) == chat.choices[0].message.content
    legacy = client.completions.create(
        model=model, prompt="Hi", max_tokens=4, temperature=0, logprobs=2
    )
    assert len(legacy.choices[0].logprobs.token_logprobs) == 4


def test_multibyte_streaming_is_exact(server: Server, model: str) -> None:
    client = server.client()
    prompt = "Translate to Chinese and add emoji: I love pizza and sunshine. 我爱"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0)
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt=prompt, max_tokens=40, temperature=0, stream=True
        )
    ]
    assert "".join(pieces) == full.choices[0].text
    assert not any("\ufffd" in p for p in pieces)


def test_64_concurrent_streams_then_idle(server: Server, model: str) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model=model,
            prompt=f"Story number {i}:",
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run_all() -> list[tuple[str, str | None]]:
        client = server.async_client()
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run_all())
    assert all(reason == "length" and text for text, reason in results)
    metrics = server.wait_idle()
    assert metrics["num_requests_running"] == 0
    assert metrics["kv_cache_usage_perc"] == 0


def test_dropped_stream_is_aborted_and_frees_blocks(server: Server) -> None:
    before = server.wait_idle().get("request_success_total:abort", 0)
    body = {"prompt": "Count slowly:", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=server.headers(), timeout=30
    ) as response:
        for i, _line in enumerate(response.iter_lines()):
            if i >= 6:
                break  # leave mid-stream: closing the connection must abort the request
    metrics = server.wait_idle()
    assert metrics["kv_cache_usage_perc"] == 0 and metrics["num_requests_running"] == 0
    assert metrics["request_success_total:abort"] == before + 1


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, "body"),
        (b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
        (b'{"prompt": "hi", "temperature": -1}', 400, "temperature"),
        (b'{"prompt": "hi", "top_p": 2}', 400, "top_p"),
        (b'{"prompt": "hi", "n": 0}', 400, "n"),
        (b'{"prompt": ""}', 400, "prompt"),
        (b'{"prompt": 5}', 400, "prompt"),
        (b'{"prompt": "hi", "suffix": "x"}', 400, "suffix"),
        (b'{"prompt": "hi", "model": "gpt-4"}', 404, "model"),
        (json.dumps({"prompt": "hi " * 1100}).encode(), 400, "prompt"),
        (json.dumps({"prompt": "hi", "max_tokens": 1024}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x" * (9 << 20)}).encode(), 413, None),
    ],
)
def test_bad_requests_get_openai_errors(
    server: Server, body: bytes, status: int, param: str | None
) -> None:
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=body,
        timeout=30,
        headers={**server.headers(), "content-type": "application/json"},
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    ok = server.client().completions.create(
        model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2
    )
    assert ok.choices[0].text is not None


def test_api_key_is_required_except_for_health(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope").models.list()


def test_tokenize_detokenize_version(server: Server) -> None:
    tokens = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "Hello world"}, headers=server.headers()
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(
        f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}, headers=server.headers()
    ).json()
    assert text["prompt"] == "Hello world"
    assert "version" in httpx.get(f"{server.url}/version", headers=server.headers()).json()
