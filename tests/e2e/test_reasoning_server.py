"""`kvflow serve --reasoning-parser deepseek_r1` on the embedded SmolLM2: the model never
writes `</think>`, so under deepseek_r1 all of a chat's output is thinking. The HTTP shapes,
streamed and not, the answer-only stop strings, completions left unread, and
chat_template_kwargs, through the real processes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.server import Server, start_server

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    server = start_server("--device", "cpu", "--reasoning-parser", "deepseek_r1")
    yield server
    server.stop()


def chat(server: Server, **fields: Any) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, **fields}
    return httpx.post(
        f"{server.url}/v1/chat/completions", json=body, headers=server.headers(), timeout=60
    )


def test_the_thinking_comes_apart_streamed_and_not(server: Server) -> None:
    # "." is a stop string of the answer: the thinking goes on past its full stops
    body = chat(server, stop=["."]).json()
    message = body["choices"][0]["message"]
    assert message["content"] == "" and message["reasoning_content"]
    every_token = body["usage"]["completion_tokens"]
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": every_token}
    assert message["reasoning"] == message["reasoning_content"]
    client = server.client()
    chunks = list(
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stop=["."],
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed == message["reasoning_content"]
    assert "".join(d.content or "" for d in deltas) == ""


def test_a_response_counts_its_thinking_tokens(server: Server) -> None:
    client = server.client()
    response = client.responses.create(
        model=client.models.list().data[0].id,
        input="What is the capital of France?",
        max_output_tokens=8,
        temperature=0,
    )
    assert response.output[0].type == "reasoning"
    assert response.usage is not None and response.usage.output_tokens == 8
    assert response.usage.output_tokens_details.reasoning_tokens == 8


def test_completions_are_not_read_for_thinking(server: Server) -> None:
    client = server.client()
    out = client.completions.create(
        model=client.models.list().data[0].id,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
    )
    assert out.choices[0].text and not hasattr(out.choices[0], "reasoning_content")


def test_chat_template_kwargs(server: Server) -> None:
    assert chat(server, chat_template_kwargs={"enable_thinking": False}).status_code == 200
    refused = chat(server, chat_template_kwargs={"add_generation_prompt": False})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template_kwargs"
    counted = httpx.post(
        f"{server.url}/tokenize",
        json={"messages": MESSAGES, "chat_template_kwargs": {"tools": []}},
        headers=server.headers(),
    )
    assert counted.status_code == 400
