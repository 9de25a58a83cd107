"""What a supervisor relies on: a dead component fails loudly, SIGTERM drains cleanly."""

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

from tests.e2e.server import Server, free_port, start_server


def stream_in_background(server: Server, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A streaming completion read in a thread; the dict records chunks, errors and the end."""
    record: dict = {"chunks": 0, "error": None, "finish_reason": None, "started": threading.Event()}

    def run() -> None:
        body = {
            "prompt": "Write a long story:",
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
                timeout=60,
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
        return httpx.get(f"{server.url}{probe}", timeout=1).status_code
    except httpx.HTTPError:
        return None


def kill_mid_run(server: Server, pid: Callable[[], int]) -> None:
    """Kill the process `pid` names while three streams run: the streams end with an error,
    /health fails at once and serve exits non-zero."""
    streams = [stream_in_background(server, max_tokens=400) for _ in range(3)]
    for _, record in streams:
        assert record["started"].wait(60) and record["chunks"] > 0
    os.kill(pid(), signal.SIGKILL)
    assert wait_for(lambda: health(server) == 503, timeout=5) < 5
    for thread, record in streams:
        thread.join(timeout=30)
        assert record["error"] is not None and record["finish_reason"] is None
    assert server.proc.wait(timeout=30) != 0


def test_killing_the_executor_fails_requests_health_and_serve() -> None:
    server = start_server()
    try:
        kill_mid_run(server, lambda: server.child_pid("executor"))
    finally:
        server.stop()


def test_sigterm_drains_in_flight_requests_and_exits_zero() -> None:
    # A drain window far beyond what the streams need, even on a loaded 2-core machine.
    server = start_server("--drain-timeout", "120")
    try:
        streams = [stream_in_background(server, max_tokens=60) for _ in range(3)]
        for _, record in streams:
            assert record["started"].wait(60)
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: health(server, "/ready") == 503, timeout=5)  # /health: still alive
        refused = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": "hi"},
            headers=server.headers(),
            timeout=10,
        )
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "service_unavailable"
        for thread, record in streams:
            thread.join(timeout=120)
            assert record["error"] is None and record["finish_reason"] == "length"
        assert server.proc.wait(timeout=120) == 0
    finally:
        server.stop()


def test_full_waiting_queue_gets_429() -> None:
    server = start_server(
        "--max-num-seqs", "1", "--max-queued-requests", "1", "--drain-timeout", "1"
    )
    try:
        # One at a time: sent together, both could reach the waiting queue before the first
        # is admitted, and the second would be the one refused. Long enough that the first
        # cannot finish before the second is queued (the drain timeout ends both at once).
        streams = [stream_in_background(server, max_tokens=900)]
        wait_for(lambda: server.metrics().get("num_requests_running") == 1, timeout=120)
        streams.append(stream_in_background(server, max_tokens=900))
        wait_for(lambda: server.metrics().get("num_requests_waiting") == 1, timeout=120)
        assert server.metrics().get("num_requests_running") == 1
        refused = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": "hi"},
            headers=server.headers(),
            timeout=10,
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
        # Far more than a second of decoding on CPU: both are still running when the drain
        # timeout expires, and must end with the server's error, not a cut connection.
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
        assert first_chunk.wait(60)
        blocking = threading.Thread(target=post_whole, daemon=True)
        blocking.start()
        wait_for(lambda: server.metrics().get("num_requests_running") == 2, timeout=60)
        server.proc.send_signal(signal.SIGTERM)
        stream.join(timeout=30)
        blocking.join(timeout=30)
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
