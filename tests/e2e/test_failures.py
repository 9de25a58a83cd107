"""What a supervisor relies on: a dead component fails loudly, SIGTERM drains cleanly.

Nothing here needs the machine to be fast (or slow): where requests must still be running when
something happens, the executor is paused (SIGSTOP) until the test has seen what it needs, and
each wait is for an event (a probe's answer, a metric, a stream's end) under a loose bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx

from tests.e2e.server import Paused, Server, free_port, start_server


def stream_in_background(
    server: Server, max_tokens: int, prompt: str = "Write a long story:"
) -> tuple[threading.Thread, dict]:
    """A streaming completion read in a thread; the dict records chunks, errors and the end."""
    record: dict = {"chunks": 0, "error": None, "finish_reason": None, "started": threading.Event()}

    def run() -> None:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
        try:
            with httpx.stream(
                "POST",
                f"{server.url}/v1/completions",
                json=body,
                headers=server.headers(),
                timeout=300,  # a bound on a stall, not on how fast tokens come
            ) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        record["error"] = event["error"]
                        continue
                    record["chunks"] += 1
                    record["started"].set()
                    record["finish_reason"] = (
                        event["choices"][0]["finish_reason"] or record["finish_reason"]
                    )
        except httpx.HTTPError as exc:
            record["error"] = repr(exc)
        finally:
            record["started"].set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, record


def wait_for(condition, timeout: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.05)
    return time.monotonic() - start


def health(server: Server, probe: str = "/health") -> int | None:
    """The status of /health (alive), or of /ready; None if nothing answers."""
    try:
        return httpx.get(f"{server.url}{probe}", timeout=5).status_code
    except httpx.HTTPError:
        return None


def unhealthy_because(server: Server, probe: str = "/health") -> str | None:
    """Why /health (or /ready) answers 503; None while it answers 200 or nothing."""
    try:
        response = httpx.get(f"{server.url}{probe}", timeout=5)
    except httpx.HTTPError:
        return None
    return None if response.status_code == 200 else response.json()["error"]["message"]


def kill_mid_run(server: Server, victim: str | Callable[[], int]) -> None:
    """Kill `victim` (a component's name, or what finds the pid of a process of one) while
    three streams run (held mid-stream: the executor is paused):
    the streams end with an error, /health fails naming the death, not a silence, and serve
    exits non-zero."""
    streams = [stream_in_background(server, max_tokens=400) for _ in range(3)]
    for _, record in streams:
        assert record["started"].wait(120) and record["chunks"] > 0
    reasons: list[str] = []

    def failing() -> bool:
        reasons.extend(filter(None, [unhealthy_because(server)]))
        return bool(reasons)

    with Paused(server.child_pid("executor")):
        pid = server.child_pid(victim) if isinstance(victim, str) else victim()
        os.kill(pid, signal.SIGKILL)
        wait_for(failing, timeout=120)
    # The launcher saw the process exit (or the frontend its connection close): no silence
    # had to last for a timeout first.
    [reason] = reasons
    assert "exited with code -9" in reason or "is gone (its connection closed" in reason, reason
    for thread, record in streams:
        thread.join(timeout=120)
        assert record["error"] is not None and record["finish_reason"] is None
    assert server.proc.wait(timeout=120) != 0


def test_killing_the_executor_fails_requests_health_and_serve() -> None:
    server = start_server()
    try:
        kill_mid_run(server, "executor")
    finally:
        server.stop()


def test_sigterm_drains_in_flight_requests_and_exits_zero() -> None:
    """Three streams in flight at SIGTERM (held there: the executor is paused from before they
    start until the drain has begun) finish whole; meanwhile /ready says draining, /health
    stays 200, and new requests get 503. The drain window is far beyond the few tokens left
    (a loaded 2-core machine decoded 0.3 tokens a second)."""
    server = start_server("--drain-timeout", "600")
    try:
        with Paused(server.child_pid("executor")):
            streams = [stream_in_background(server, max_tokens=8) for _ in range(3)]
            wait_for(lambda: in_engine(server) == 3, timeout=120)
            server.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: unhealthy_because(server, "/ready") is not None, timeout=60)
            assert unhealthy_because(server, "/ready") == "the engine is unavailable: draining"
            assert health(server) == 200  # alive
            refused = httpx.post(
                f"{server.url}/v1/completions",
                json={"prompt": "hi"},
                headers=server.headers(),
                timeout=60,
            )
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "service_unavailable"
        for thread, record in streams:
            thread.join(timeout=600)
            assert record["error"] is None and record["finish_reason"] == "length"
        assert server.proc.wait(timeout=120) == 0
    finally:
        server.stop()


def in_engine(server: Server) -> float:
    """Requests the scheduler holds, running or waiting."""
    values = server.metrics()
    return values.get("num_requests_running", 0) + values.get("num_requests_waiting", 0)


def test_full_waiting_queue_gets_429() -> None:
    server = start_server(
        "--max-num-seqs", "1", "--max-queued-requests", "1", "--drain-timeout", "1"
    )
    try:
        # One at a time: sent together, both could reach the waiting queue before the first
        # is admitted, and the second would be the one refused. The executor is paused once
        # the first runs, so it cannot finish before the second is queued (the drain timeout
        # ends both at once).
        streams = [stream_in_background(server, max_tokens=900)]
        wait_for(lambda: server.metrics().get("num_requests_running") == 1, timeout=120)
        with Paused(server.child_pid("executor")):
            streams.append(stream_in_background(server, max_tokens=900))
            wait_for(lambda: server.metrics().get("num_requests_waiting") == 1, timeout=120)
            assert server.metrics().get("num_requests_running") == 1
            refused = httpx.post(
                f"{server.url}/v1/completions",
                json={"prompt": "hi"},
                headers=server.headers(),
                timeout=60,
            )
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["type"] == "rate_limit_error"
        for thread, _ in streams:
            thread.join(timeout=1)
    finally:
        server.stop()


def test_drain_timeout_ends_streams_with_an_error_and_exits_zero() -> None:
    server = start_server("--drain-timeout", "1")
    try:
        # Both are still running when the drain timeout expires (the executor is paused from
        # before SIGTERM until they have ended), and must end with the server's error, not a
        # cut connection.
        body = {
            "prompt": "Write a long story:",
            "max_tokens": 900,
            "ignore_eos": True,
            "temperature": 0,
        }
        lines: list[str] = []
        first_chunk = threading.Event()
        whole: dict = {}

        def read_stream() -> None:
            try:
                with httpx.stream(
                    "POST",
                    f"{server.url}/v1/completions",
                    json={**body, "stream": True},
                    headers=server.headers(),
                    timeout=60,
                ) as response:
                    for line in response.iter_lines():
                        if line:
                            lines.append(line)
                            first_chunk.set()
            except httpx.HTTPError as exc:
                lines.append(f"cut off: {exc!r}")
            finally:
                first_chunk.set()

        def post_whole() -> None:
            whole["response"] = httpx.post(
                f"{server.url}/v1/completions", json=body, headers=server.headers(), timeout=60
            )

        stream = threading.Thread(target=read_stream, daemon=True)
        stream.start()
        assert first_chunk.wait(120)
        blocking = threading.Thread(target=post_whole, daemon=True)
        blocking.start()
        wait_for(lambda: server.metrics().get("num_requests_running") == 2, timeout=120)
        with Paused(server.child_pid("executor")):
            server.proc.send_signal(signal.SIGTERM)
            stream.join(timeout=120)
            blocking.join(timeout=120)
        assert not stream.is_alive() and not blocking.is_alive()

        assert lines[-1] == "data: [DONE]", lines[-1]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-2]]
        assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)

        refused = whole["response"]
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert "shutting down" in refused.json()["error"]["message"]
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()


def test_sigterm_while_the_engine_starts_drains_and_exits_zero() -> None:
    """A SIGTERM that comes while the model loads (the frontend answers /health, serve has not
    said it serves) is a drain like any other: serve exits 0, not as a failed start."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        server = Server(proc, port)
        wait_for(lambda: _answers(f"{server.url}/health"), timeout=120)
        assert httpx.get(f"{server.url}/ready").status_code == 503  # still starting
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
