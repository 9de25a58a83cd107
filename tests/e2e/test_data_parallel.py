"""`kvflow serve --data-parallel-size 2` on CPU: two engine replicas behind the frontends (four
by default) and one tokenizer pool. Requests are served on both (their metrics carry a replica
label), a repeated long prefix goes to the replica that holds it, and a replica busy with a
long request does not hold up the others' requests.

One server for the module (its tests run in order, on one worker): the long request of the
last test is still running when the server stops, which its drain timeout cuts short."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.server import Server, start_server
from tests.e2e.test_failures import stream_in_background, wait_for

MODEL = "SmolLM2-135M-Instruct"


def per_replica(server: Server, name: str) -> dict[int, float]:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers()).text
    pattern = rf'^kvflow:{name}\{{[^}}]*replica="(\d+)"\}} (\S+)$'
    return {int(m[1]): float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


def complete(server: Server, prompt: str | list[int], max_tokens: int = 4) -> None:
    server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    server = start_server(
        "--data-parallel-size", "2", "--tokenizer-pool-size", "2", "--drain-timeout", "1"
    )
    try:
        yield server
    finally:
        server.stop()


def test_two_replicas_share_the_requests_and_keep_prefixes_together(server: Server) -> None:
    """First: both replicas are idle and hold no prefix yet."""
    for n in range(4):  # cold prompts: the replicas take them in turn
        complete(server, [100 + n] * 20)
    wait_for(lambda: len(per_replica(server, "prompt_tokens_total")) == 2, timeout=10)
    wait_for(lambda: min(per_replica(server, "prompt_tokens_total").values()) > 0, timeout=10)

    shared = [(37 * n) % 5000 + 200 for n in range(160)]  # ten blocks of 16
    before = per_replica(server, "prefix_cache_hits_total")
    for n in range(4):  # the same long prefix, a new tail each time
        complete(server, [*shared, 7000 + n])
    expected_hits = 3 * len(shared)

    def hits() -> list[float]:
        now = per_replica(server, "prefix_cache_hits_total")
        return sorted(now[r] - before.get(r, 0) for r in now)

    wait_for(lambda: hits()[1] >= expected_hits, timeout=10)
    assert hits()[0] == 0  # every repeat went to the replica holding the prefix


def test_a_replica_busy_with_a_long_request_does_not_hold_up_the_other(server: Server) -> None:
    """Last: its long request runs on until the server stops."""
    _, record = stream_in_background(server, max_tokens=600)
    assert record["started"].wait(60) and record["chunks"] > 0
    running = per_replica(server, "num_requests_running")
    busy = max(running, key=lambda r: running[r])
    idle = 1 - busy
    before = per_replica(server, "generation_tokens_total").get(idle, 0)
    for n in range(3):  # less busy: the short ones go to the idle replica
        complete(server, [300 + n] * 20, max_tokens=8)
    wait_for(
        lambda: per_replica(server, "generation_tokens_total")[idle] >= before + 24,
        timeout=10,
    )
