"""`kvflow serve --speculative-config` through the openai client: the embedded SmolLM2's answers
are those of the server without speculation (the shared default server), whole, streamed and
cut by a stop string inside a run of accepted drafts; /metrics counts the drafts."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.e2e.server import Server, start_server

MODEL = "SmolLM2-135M-Instruct"
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
# An answer that quotes its prompt, as edits do: n-gram drafts are accepted.
CODE = "def area(width, height):\n    result = width * height\n    return result\n"
MESSAGES = [
    {
        "role": "user",
        "content": f"Add a docstring to this function. Reply with code only.\n\n{CODE}",
    }
]


@pytest.fixture(scope="module")
def spec_server() -> Iterator[Server]:
    server = start_server("--device", "cpu", "--speculative-config", json.dumps(SPEC))
    yield server
    server.stop()


def answer(server: Server, **extra: object) -> tuple[str, str | None, int]:
    reply = server.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=64,
        **extra,  # type: ignore[arg-type]
    )
    choice = reply.choices[0]
    assert reply.usage is not None
    return choice.message.content or "", choice.finish_reason, reply.usage.completion_tokens


def test_answers_are_those_without_speculation(spec_server: Server, default_server: Server) -> None:
    before = spec_server.wait_idle()
    expected = answer(default_server)
    assert answer(spec_server) == expected
    stream = spec_server.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=64,
        stream=True,  # type: ignore[arg-type]
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected[0]
    after = spec_server.wait_idle()
    accepted = after["spec_decode_num_accepted_tokens_total"]
    assert accepted > before.get("spec_decode_num_accepted_tokens_total", 0)
    assert after["spec_decode_num_drafts_total"] > 0
    assert after["num_requests_running"] == 0 and after["kv_cache_usage_perc"] == 0


def test_a_stop_string_inside_accepted_drafts_cuts_at_its_place(
    spec_server: Server, default_server: Server
) -> None:
    text, _, _ = answer(default_server)
    # Where the answer quotes the prompt's code, drafts run ahead of the stop string.
    stop = "* height"
    assert stop in text
    expected = answer(default_server, stop=[stop])
    assert expected[0] == text[: text.index(stop)] and expected[1] == "stop"
    assert answer(spec_server, stop=[stop]) == expected
