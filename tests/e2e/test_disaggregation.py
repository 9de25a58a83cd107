"""`kvflow serve --data-parallel-size 3 --prefill-replicas 1` on CPU: replica 0 computes each
prompt and its first token, a decode replica (1 or 2) fetches the prompt's KV from replica 0's
executor and generates the rest. Greedy outputs equal one engine's token for token (the
embedded model in this process, as the tensor-parallel server's test compares: no second
server), streamed or not, with logprobs and prompt logprobs, each of n choices handed over on
its own; the metrics show the blocks handed over each way and no failed fetch; a request that
ends with its first token stays where it started. Last, killing a decode replica fails only
the request it held: the other replica's runs to its end, then serve exits non-zero."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvflow import LLM, SamplingParams
from tests.e2e.server import Paused, Server, start_server
from tests.e2e.test_failures import stream_in_background, unhealthy_because, wait_for

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "The history of the Roman empire is long and complicated. It began with the founding of"
    " the city of Rome, which according to legend",
    "def fibonacci(n):\n    " * 6,
    "Hi",  # no full block: nothing to hand over, the decode replica computes it all
]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    server = start_server(
        *("--data-parallel-size", "3", "--prefill-replicas", "1"),
        *("--tokenizer-pool-size", "1", "--api-server-count", "1", "--drain-timeout", "120"),
    )
    try:
        yield server
    finally:
        server.stop()


def metric(server: Server, name: str) -> dict[int, float]:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers()).text
    pattern = rf'^kvflow:{name}\{{[^}}]*replica="(\d+)"\}} (\S+)$'
    return {int(m[1]): float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


def decoded(server: Server) -> float:
    """Tokens the decode replicas generated."""
    generated = metric(server, "generation_tokens_total")
    return generated.get(1, 0) + generated.get(2, 0)


def complete(server: Server, prompt: str, **params: Any) -> Any:
    return server.client().completions.create(
        model=MODEL, prompt=prompt, temperature=0, **{"max_tokens": 24, **params}
    )


def test_greedy_outputs_equal_one_engines(server: Server, smollm2: LLM) -> None:
    for prompt, want in zip(PROMPTS, smollm2.generate(PROMPTS, GREEDY), strict=True):
        got = complete(server, prompt, logprobs=2)
        assert got.choices[0].text == want.text
        assert len(got.choices[0].logprobs.token_logprobs) == 24
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == 24
    exported = metric(server, "kv_transfer_blocks_exported_total")
    wait_for(lambda: sum(metric(server, "kv_transfer_blocks_imported_total").values()) > 0, 10)
    imported = metric(server, "kv_transfer_blocks_imported_total")
    assert exported[0] == imported.get(1, 0) + imported.get(2, 0) > 0
    assert exported.get(1, 0) == exported.get(2, 0) == 0
    assert sum(metric(server, "kv_transfer_failed_imports_total").values()) == 0
    generated = metric(server, "generation_tokens_total")
    assert generated[0] == len(PROMPTS) and decoded(server) == len(PROMPTS) * 23


def test_each_of_n_choices_is_handed_over_on_its_own(server: Server, smollm2: LLM) -> None:
    want = smollm2.generate([PROMPTS[0]], GREEDY)[0].text
    before = metric(server, "kv_transfer_blocks_exported_total").get(0, 0)
    got = complete(server, PROMPTS[0], n=2)
    assert [choice.text for choice in got.choices] == [want, want]
    exported = metric(server, "kv_transfer_blocks_exported_total").get(0, 0) - before
    assert exported == 2 * (got.usage.prompt_tokens // 16)


def test_a_streamed_chat_equals_one_engines(server: Server, smollm2: LLM) -> None:
    messages = [
        {"role": "user", "content": "Name three rivers of Europe, and say why each matters."}
    ]
    stream = server.client().chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=32, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    want = smollm2.chat([messages], SamplingParams(temperature=0, max_tokens=32))[0].text
    assert text == want


def test_prompt_logprobs_come_from_the_prefill_replica(server: Server, smollm2: LLM) -> None:
    got = complete(server, PROMPTS[0], max_tokens=4, extra_body={"prompt_logprobs": 1})
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    [want] = smollm2.generate([PROMPTS[0]], params)
    served = got.choices[0].model_extra["prompt_logprobs"]
    assert want.prompt_logprobs is not None and served[0] is None
    assert len(served) == len(want.prompt_logprobs)
    for position, entry in zip(served[1:], want.prompt_logprobs[1:], strict=True):
        assert entry.logprob is not None
        assert entry.logprob == pytest.approx(position[str(entry.token_id)]["logprob"], abs=1e-4)
    assert got.choices[0].text == want.text


def test_a_request_of_one_token_is_not_handed_over(server: Server) -> None:
    before = metric(server, "kv_transfer_blocks_exported_total").get(0, 0)
    generated = decoded(server)
    assert complete(server, PROMPTS[0] + " again", max_tokens=1).usage.completion_tokens == 1
    assert metric(server, "kv_transfer_blocks_exported_total").get(0, 0) == before
    assert decoded(server) == generated


def replica_pid(server: Server, component: str, replica: int) -> int:
    return server.child_pid(f"{component} .*--data-parallel-rank {replica}")


def test_killing_a_decode_replica_fails_only_its_request(server: Server) -> None:
    """Two streams, one on each decode replica (different prompts: the router spreads them by
    load), held there (both decode executors paused). Replica 2's scheduler and executor are
    killed: its stream ends with an error naming it, /health fails naming it, and replica 1's
    stream runs to its end; serve then exits non-zero. Last in the module: it ends the server."""

    def running() -> list[float]:
        found = metric(server, "num_requests_running")
        return [found.get(1, 0), found.get(2, 0)]

    with Paused(replica_pid(server, "executor", 1)), Paused(replica_pid(server, "executor", 2)):
        # One after the other: the second, with no block held anywhere, goes to the replica
        # without the first (the one that holds the first's prompt may hold more of it).
        streams = [stream_in_background(server, 48, PROMPTS[1])]
        wait_for(lambda: sum(running()) == 1, timeout=120)
        streams.append(stream_in_background(server, 48))
        wait_for(lambda: running() == [1, 1], timeout=120)
        for component in ("executor", "scheduler"):
            os.kill(replica_pid(server, component, 2), signal.SIGKILL)
        wait_for(lambda: unhealthy_because(server) is not None, timeout=60)
        assert "r2-" in (unhealthy_because(server) or "")
    for thread, _ in streams:
        thread.join(timeout=300)
    records = sorted((record for _, record in streams), key=lambda r: r["error"] is None)
    failed, finished = records
    assert "engine replica 2 is down" in str(failed["error"]), failed
    assert finished["error"] is None and finished["finish_reason"] == "length", finished
    assert server.proc.wait(timeout=120) != 0
