"""Overload, deadlines, a stalled engine and slow clients, against a real `kvflow serve`.

The engine is paused for real where a test needs requests to pile up: the executor process
gets SIGSTOP (nothing progresses, so what the queue admits and refuses is exact, whatever the
machine's speed) and SIGCONT once the test has seen what it needs. A paused executor is slow,
not dead: its heartbeats stop but its connections stay open, so only silence past
--component-timeout would fail it, and that is raised far beyond any pause here.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.server import Paused, Server, start_server

QUEUE = 4  # --max-queued-requests
QUEUED_TOKENS = 100  # --max-queued-tokens
PROMPT_IDS = list(range(1000, 1005))  # five ordinary token ids of the embedded model


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    server = start_server(
        "--max-num-seqs",
        "1",
        "--max-queued-requests",
        str(QUEUE),
        "--max-queued-tokens",
        str(QUEUED_TOKENS),
        "--component-timeout",
        "120",
    )
    yield server
    server.stop()


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def paused(server: Server) -> Paused:
    """The executor stopped for the block: no step ends, nothing leaves the queue."""
    return Paused(server.child_pid("executor"))


def complete(server: Server, prompt: list[int], max_tokens: int = 8, **extra: object):
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    return httpx.post(
        f"{server.url}/v1/completions", json=body, headers=server.headers(), timeout=120
    )


def burst(server: Server, prompts: list[list[int]], num_refused: int) -> list[httpx.Response]:
    """While the engine is paused: send the first prompt and wait until it runs (the only
    running slot: --max-num-seqs 1), then every other prompt at once; resume once
    `num_refused` answers came back (the refusals: nothing else can end while paused).

    Why the first apart: sent with the others, it may still be waiting when the queue fills,
    and the frontend, told the queue is full, refuses one more up front."""
    with ThreadPoolExecutor(len(prompts)) as pool, paused(server):
        futures = [pool.submit(complete, server, prompts[0])]
        wait_until(lambda: server.metrics()["num_requests_running"] == 1, "nothing runs")
        futures += [pool.submit(complete, server, p) for p in prompts[1:]]
        wait_until(lambda: sum(f.done() for f in futures) >= num_refused, "no refusals came")
        assert sum(f.done() for f in futures) == num_refused  # the admitted ones wait
    return [f.result() for f in futures]


def test_twice_the_queue_at_once_refuses_the_excess_and_completes_the_rest(
    server: Server,
) -> None:
    capacity = 1 + QUEUE  # one running (--max-num-seqs 1), QUEUE waiting
    answers = burst(server, [PROMPT_IDS] * 2 * capacity, num_refused=capacity)
    refused = [a for a in answers if a.status_code == 429]
    served = [a for a in answers if a.status_code == 200]
    assert (len(refused), len(served)) == (capacity, capacity)
    for answer in refused:
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "queue_full"
    for answer in served:  # admitted: never dropped, and complete
        assert answer.json()["usage"]["completion_tokens"] == 8
    values = server.wait_idle()
    assert values["request_refused_total"] == capacity


def test_the_token_bound_refuses_a_burst_of_long_prompts(server: Server) -> None:
    long_prompt = list(range(1000, 1040))  # 40 tokens: two fit in the 100-token queue
    before = server.metrics()["request_refused_total"]
    answers = burst(server, [long_prompt] * 6, num_refused=3)  # 1 running + 2 waiting
    assert sorted(a.status_code for a in answers) == [200] * 3 + [429] * 3
    refusal = next(a for a in answers if a.status_code == 429).json()["error"]["message"]
    assert "--max-queued-tokens" in refusal
    assert server.wait_idle()["request_refused_total"] == before + 3


def test_a_request_past_its_timeout_ends_with_504_and_frees_its_blocks(server: Server) -> None:
    before = server.metrics().get("request_success_total:timeout", 0)
    with paused(server):
        answer = complete(server, PROMPT_IDS, timeout=0.5)
    assert answer.status_code == 504
    assert answer.json()["error"]["code"] == "request_timeout"
    values = server.wait_idle()
    assert (values["kv_cache_usage_perc"], values["num_requests_running"]) == (0, 0)
    assert values["request_success_total:timeout"] == before + 1


def test_a_streamed_request_past_its_timeout_gets_an_error_event(server: Server) -> None:
    # The timeout leaves the first token ample time; then the engine is paused for good.
    body = {"prompt": PROMPT_IDS, "max_tokens": 500, "ignore_eos": True, "stream": True}
    events: list[str] = []
    executor = paused(server)
    try:
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            json={**body, "timeout": 10.0},
            headers=server.headers(),
            timeout=120,
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line and not events:
                    executor.__enter__()  # the stream has started: now nothing progresses
                events += [line] if line else []
    finally:
        executor.__exit__()
    assert events[-1] == "data: [DONE]"
    assert '"code":"request_timeout"' in events[-2].replace(" ", "")
    assert server.wait_idle()["kv_cache_usage_perc"] == 0


def test_idle_connections_and_a_client_that_stops_reading_do_not_hold_others_up(
    server: Server,
) -> None:
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(500)]
    stalled = socket.create_connection(("127.0.0.1", server.port))
    try:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        body = b'{"prompt": [1000, 1001], "max_tokens": 100, "ignore_eos": true, "stream": true}'
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {server.headers()['Authorization'][7:]}\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )  # and never read a byte of the answer
        answer = complete(server, PROMPT_IDS)
        assert answer.status_code == 200
        assert answer.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        stalled.close()
        for connection in idle:
            connection.close()
    assert server.wait_idle(timeout=60)["kv_cache_usage_perc"] == 0


def test_a_stalled_executor_step_trips_the_watchdog() -> None:
    """A step that never ends while the executor's heartbeats go on (--fault-hang-step): the
    request fails, /health turns 503 naming the stall, and `kvflow serve` exits non-zero."""
    server = start_server("--engine-stall-timeout", "3", "--fault-hang-step", "6")
    failures: list[str] = []  # what /health said while it failed
    watching = threading.Event()

    def watch_health() -> None:
        while server.proc.poll() is None:
            try:
                response = httpx.get(f"{server.url}/health", timeout=2)
                if response.status_code == 503:
                    failures.append(response.json()["error"]["message"])
            except httpx.HTTPError:
                pass
            watching.set()
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    try:
        watching.wait(30)
        answer = complete(server, PROMPT_IDS, max_tokens=50)
        assert answer.status_code == 503
        message = answer.json()["error"]["message"]
        assert "stalled" in message or "exited with code 70" in message
        assert server.proc.wait(timeout=60) != 0
        watcher.join(10)
        assert any("executor-0 is stalled: step 6 has made no progress" in f for f in failures)
    finally:
        server.stop()
