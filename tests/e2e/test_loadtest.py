"""loadtest/locustfile.py run as locust runs it: headless, in its own process (locust patches the
standard library with gevent, so it is never imported here), read back from its CSV files."""

from __future__ import annotations

import csv
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server import API_KEY, Server

LOCUSTFILE = Path(__file__).parents[2] / "loadtest" / "locustfile.py"
METRICS = ("ttft", "itl", "tpot", "output_tok_per_s")
SCENARIOS = ("random", "shared-prefix", "multi-turn", "cancel")
Stats = dict[tuple[str, str], dict[str, str]]


def run_locust(host: str, out: Path, *flags: str, api_key: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPENAI_API_KEY": api_key}
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless"]
    command += ["--host", host, "--csv", str(out), "--only-summary", *flags]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def read_stats(out: Path) -> Stats:
    with open(f"{out}_stats.csv", newline="") as file:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(file)}


def count(stats: Stats, kind: str, name: str) -> int:
    row = stats.get((kind, name))
    return 0 if row is None else int(row["Request Count"])


@pytest.mark.slow
def test_every_scenario_against_kvflow_serve(tmp_path: Path, default_server: Server) -> None:
    """Six users for 20 s across the four scenarios, with tiny outputs (CPU): no failure, every
    figure reported, the CSV agrees with the server's counters, and the server ends idle. The
    server is shared (tests/e2e/conftest.py): its counters are read before and after."""
    server = default_server
    before = server.wait_idle()
    started = time.monotonic()
    result = run_locust(
        server.url,
        tmp_path / "out",
        *("-u", "6", "-r", "6", "-t", "20s", "--stop-timeout", "30"),
        *("--ignore-eos", "--max-tokens", "8", "--random-output-min", "2"),
        *("--random-output-max", "8", "--random-input-min", "4", "--random-input-max", "48"),
        *("--shared-prefix-words", "128", "--question-words", "8", "--turns", "3"),
        *("--cancel-after", "2", "--cancel-fraction", "1"),  # every cancel stream: no chance
        api_key=API_KEY,
    )
    after = server.wait_idle()
    elapsed = time.monotonic() - started

    def grew(name: str) -> float:
        return after[name] - before[name]

    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # The engine's steps ran one at a time for part of the run: busy, never longer than it.
    assert 0 < grew("device_busy_seconds_total") < elapsed
    stats = read_stats(tmp_path / "out")
    assert stats[("", "Aggregated")]["Failure Count"] == "0"

    streams = {
        name: int(row["Request Count"]) for (kind, name), row in stats.items() if kind == "POST"
    }
    for scenario in SCENARIOS:
        assert any(name.startswith(f"{scenario} ") for name in streams), streams
    closed_early = sum(n for name, n in streams.items() if name.endswith("(closed early)"))
    read_to_end = sum(streams.values()) - closed_early
    assert closed_early > 0, streams
    for metric in METRICS:
        assert count(stats, "METRIC", metric) > 0, metric
    # Every stream read to its end reports its throughput; no stream has more first tokens
    # than one, nor more content chunks than the server generated tokens.
    assert count(stats, "METRIC", "output_tok_per_s") == read_to_end
    assert count(stats, "METRIC", "ttft") <= read_to_end + closed_early
    num_chunks = count(stats, "METRIC", "ttft") + count(stats, "METRIC", "itl")
    assert num_chunks <= grew("generation_tokens_total")
    assert count(stats, "GET", "/v1/models") == 6  # once per user

    # Every request the server saw ended exactly once, by length (ignore_eos) or, for a
    # stream closed early, by length or abort; none with an error. No KV block is left held.
    assert grew("request_success_total:stop") == 0
    assert grew("request_success_total:error") == 0
    assert grew("request_success_total:abort") <= closed_early
    assert (
        grew("request_success_total:length") + grew("request_success_total:abort")
        == read_to_end + closed_early
    )
    idle = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    assert [after[name] for name in idle] == [0, 0, 0]


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def chunk(text: str) -> bytes:
    # Both routes' shapes in one chunk: chat reads the delta, completions the text.
    return sse({"choices": [{"index": 0, "text": text, "delta": {"content": text}}]})


def usage(num_tokens: int) -> bytes:
    return sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": num_tokens}})


DONE = b"data: [DONE]\n\n"
# What the fake server streams, in turn, for a request of max_tokens n; and the failure each
# fault must be reported as.
ANSWERS = [
    lambda n: [chunk("a"), chunk("b"), usage(n), DONE],
    lambda n: [chunk("a"), usage(n)],
    lambda n: [chunk("a"), sse({"error": {"message": "engine died"}}), DONE],
    lambda n: [chunk("a"), chunk("b"), usage(n - 1), DONE],
    lambda n: [chunk("a"), b"data: {not json\n\n", DONE],
    lambda n: [chunk("a"), b"data: [1, 2]\n\n", DONE],
    None,  # HTTP 500
]
FAILURES = {
    "stream ended without [DONE]",
    "error event: engine died",
    "usage.completion_tokens is 3, max_tokens 4 (ignore_eos)",
    "an SSE event that is not a JSON object",
    "HTTP 500: overloaded",
}


class FakeServer(ThreadingHTTPServer):
    """An OpenAI-compatible server that answers streaming requests with ANSWERS in turn, and
    keeps every request body and Authorization header it was sent."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.answers = itertools.cycle(ANSWERS)
        self.lock = threading.Lock()
        self.requests: list[tuple[str | None, dict[str, Any]]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class FakeHandler(BaseHTTPRequestHandler):
    server: FakeServer

    def do_GET(self) -> None:
        self.reply(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append((self.headers["Authorization"], body))
            answer = next(self.server.answers)
        if answer is None:
            self.reply(500, {"error": {"message": "overloaded", "type": "internal_error"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in answer(body["max_tokens"]):
            self.wfile.write(event)

    def reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would bury the test's output


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_each_fault_of_a_stream_is_a_failure(tmp_path: Path, fake_server: FakeServer) -> None:
    """Two rounds of the fake server's answers (--num-requests, not a run time: on a loaded
    machine a 3-second run once ended before the seventh answer)."""
    result = run_locust(
        fake_server.url,
        tmp_path / "out",
        *("-u", "2", "-r", "2", "-t", "100s", "--tags", "random", "--ignore-eos"),
        *("--random-output-min", "4", "--random-output-max", "4"),
        *("--num-requests", str(2 * len(ANSWERS))),
        api_key="sk-fake",
    )
    assert result.returncode == 1  # locust's exit code when a request failed
    with open(tmp_path / "out_failures.csv", newline="") as file:
        errors = {row["Error"] for row in csv.DictReader(file)}
    assert {error.split("'")[1] for error in errors} == FAILURES, errors
    with open(tmp_path / "out_exceptions.csv", newline="") as file:
        assert list(csv.DictReader(file)) == []  # every fault was caught and reported

    stats = read_stats(tmp_path / "out")
    aggregated = stats[("", "Aggregated")]
    num_streams = sum(int(r["Request Count"]) for (kind, _), r in stats.items() if kind == "POST")
    num_failed = int(aggregated["Failure Count"])
    assert 0 < num_failed < num_streams
    # Only the streams without a fault report figures.
    assert count(stats, "METRIC", "output_tok_per_s") == num_streams - num_failed

    authorization, body = fake_server.requests[0]
    assert authorization == "Bearer sk-fake"
    assert body["model"] == "fake-model"  # the first id of /v1/models
    assert (body["stream"], body["stream_options"], body["ignore_eos"]) == (
        True,
        {"include_usage": True},
        True,
    )
