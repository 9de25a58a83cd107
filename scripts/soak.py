"""A soak: mixed, partly hostile traffic against a real `kvflow serve`, then the books.

Runs `kvflow serve` on the embedded model with a KV cache small enough that long prompts force
preemption, and sends, from several concurrent clients for `--duration` seconds: streamed
chats, completions with n > 1, streams the client abandons part-way, requests that fail
validation, long prompts, and requests whose `timeout` expires. Afterwards it checks that

- nothing leaked: /metrics back to idle (no request running or waiting, no KV block in use,
  nothing in flight in the frontend);
- every request ended exactly once, as it should: the client saw the outcome its scenario
  expects (a stream ends with [DONE], a bad request is 400, an expired one 504), and the
  server's finished counters (by reason) add up to the sub-requests (prompt x n) that passed
  validation, each counted once;
- every process's resident memory grew by less than `--rss-slack` over the run (measured after
  a warm-up and at the end).

Before the traffic it also times a short request alone and beside 500 idle connections and a
client that never reads its stream (reported, not checked).

It writes the figures as JSON (`--json`) and exits non-zero when a check fails.
`scripts/soak.sh` runs it for 10 minutes; CI runs a 30-second version (tests/e2e/test_soak.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

API_KEY = "sk-soak"
LONG_TEXT = " ".join(f"item {i} of the inventory is a lamp" for i in range(30))  # ~270 tokens
# Each scenario and the outcomes it may end in; anything else fails the soak.
EXPECTED = {
    "stream": {"stream-done"},
    "cancel": {"stream-cancelled", "stream-done"},  # done: it ended before the client left
    "n2": {"200"},
    "bad": {"400"},
    "long": {"200"},
    "deadline": {"504"},
}
SCENARIOS = tuple(EXPECTED)
EXPECTED["slow-clients"] = {"done"}  # the latency probe before the traffic (slow_clients)


@dataclass
class Books:
    """What the client sent and saw."""

    sent: Counter[str] = field(default_factory=Counter)  # by scenario
    outcomes: Counter[str] = field(default_factory=Counter)  # by status or stream end
    sub_requests: int = 0  # prompt x n of every request that passed validation


async def chat_stream(client: httpx.AsyncClient, books: Books, cancel_after: int | None) -> str:
    body = {
        "messages": [{"role": "user", "content": "Tell me about lamps."}],
        "max_tokens": 48,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return str(response.status_code)
        books.sub_requests += 1
        events = 0
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return "stream-done"
            events += line.startswith("data:")
            if cancel_after is not None and events >= cancel_after:
                return "stream-cancelled"  # leaving the block closes the connection
    return "stream-cut"  # the server closed it without [DONE]


async def completion(client: httpx.AsyncClient, books: Books, body: dict[str, Any]) -> str:
    response = await client.post("/v1/completions", json=body)
    if response.status_code not in (400, 404, 422):
        books.sub_requests += len(body["prompt"]) * body.get("n", 1)
    return str(response.status_code)


async def one_request(client: httpx.AsyncClient, books: Books, rng: random.Random) -> None:
    scenario = rng.choice(SCENARIOS)
    books.sent[scenario] += 1
    try:
        outcome = await send(client, books, rng, scenario)
    except httpx.HTTPError as exc:
        outcome = f"transport error {type(exc).__name__}"
    books.outcomes[f"{scenario}:{outcome}"] += 1


async def send(client: httpx.AsyncClient, books: Books, rng: random.Random, scenario: str) -> str:
    if scenario == "stream":
        outcome = await chat_stream(client, books, cancel_after=None)
    elif scenario == "cancel":
        outcome = await chat_stream(client, books, cancel_after=rng.randint(1, 6))
    elif scenario == "n2":
        body = {"prompt": ["Lamps are", "A lamp is"], "n": 2, "max_tokens": 16, "seed": 1}
        outcome = await completion(client, books, body)
    elif scenario == "bad":
        outcome = await completion(client, books, {"prompt": ["hi"], "temperature": -1})
    elif scenario == "long":
        body = {"prompt": [LONG_TEXT], "max_tokens": 32, "ignore_eos": True}
        outcome = await completion(client, books, body)
    else:  # deadline: far more tokens than the timeout allows on any machine
        body = {"prompt": ["Lamps"], "max_tokens": 400, "ignore_eos": True, "timeout": 0.05}
        outcome = await completion(client, books, body)
    return outcome


async def client_loop(url: str, books: Books, seed: int, until: float) -> None:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as client:
        while time.monotonic() < until:
            await one_request(client, books, rng)


# ---------------------------------------------------------------- the server


def start_server(port: int, kv_bytes: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    argv = [sys.executable, "-m", "services", "serve", "--port", str(port)]
    argv += ["--api-key", API_KEY, "--max-model-len", "1024"]
    argv += ["--kv-cache-memory-bytes", str(kv_bytes), "--max-queued-requests", "100000"]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kvflow serve exited with {proc.returncode} during startup")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("kvflow serve did not become ready")


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^kvflow:(\w+)\{([^}]*)\} (\S+)$", line)
        if match is None or match.group(1).endswith("_bucket"):
            continue
        reason = re.search(r'finished_reason="(\w+)"', match.group(2))
        values[match.group(1) + (f":{reason.group(1)}" if reason else "")] = float(match.group(3))
    return values


def wait_idle(url: str, timeout: float = 120) -> dict[str, float]:
    keys = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(url)
        idle = all(values.get(k) == 0 for k in keys)
        if (idle and values.get("frontend_requests_in_flight") == 0) or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


def rss_by_process(proc: subprocess.Popen[bytes]) -> dict[str, int]:
    """Resident bytes of `kvflow serve` and each component, by component name."""
    serve = psutil.Process(proc.pid)
    out = {"serve": serve.memory_info().rss}
    for child in serve.children():
        cmdline = child.cmdline()
        name = cmdline[3] if len(cmdline) > 3 else str(child.pid)
        if "--worker-index" in cmdline:
            name += "-" + cmdline[cmdline.index("--worker-index") + 1]
        out[name] = child.memory_info().rss
    return out


# ---------------------------------------------------------------- the run


def latency_s(url: str, num: int = 5) -> float:
    """Median seconds of a short completion, one at a time."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "Lamps are", "max_tokens": 8, "ignore_eos": True}
    times = []
    for _ in range(num):
        start = time.monotonic()
        httpx.post(
            f"{url}/v1/completions", json=body, headers=headers, timeout=120
        ).raise_for_status()
        times.append(time.monotonic() - start)
    return sorted(times)[num // 2]


def slow_clients(url: str, port: int, books: Books) -> dict[str, float]:
    """A short request's latency alone, then beside 500 connections that send nothing and a
    stream whose client never reads (reported, not checked: timings vary by machine). Its 11
    requests go into the books."""
    alone = latency_s(url)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(500)]
    reader = socket.create_connection(("127.0.0.1", port))
    body = b'{"prompt": "Lamps", "max_tokens": 64, "ignore_eos": true, "stream": true}'
    reader.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        beside = latency_s(url)
    finally:
        for connection in [*idle, reader]:
            connection.close()
    books.sent["slow-clients"] += 11
    books.outcomes["slow-clients:done"] += 11
    books.sub_requests += 11
    return {"alone_s": round(alone, 3), "beside_slow_clients_s": round(beside, 3)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port, args.kv_bytes)
    try:
        wait_ready(url, proc)
        books = Books()
        slow = slow_clients(url, port, books)
        warm_up = min(args.duration / 6, 30.0)
        asyncio.run(traffic(url, books, args, warm_up))  # the warm-up: same traffic, shorter
        rss_start = rss_by_process(proc)
        started = time.monotonic()
        asyncio.run(traffic(url, books, args, args.duration))
        elapsed = time.monotonic() - started
        values = wait_idle(url)
        rss_end = rss_by_process(proc)
        alive = proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    return {**verdict(args, books, values, rss_start, rss_end, elapsed, alive), "latency": slow}


async def traffic(url: str, books: Books, args: argparse.Namespace, seconds: float) -> None:
    until = time.monotonic() + seconds
    seeds = [args.seed * 1000 + len(books.sent) + k for k in range(args.concurrency)]
    await asyncio.gather(*(client_loop(url, books, seed, until) for seed in seeds))


def verdict(
    args: argparse.Namespace,
    books: Books,
    values: dict[str, float],
    rss_start: dict[str, int],
    rss_end: dict[str, int],
    elapsed: float,
    alive: bool,
) -> dict[str, Any]:
    finished = {k.split(":", 1)[1]: v for k, v in values.items() if k.startswith("request_success")}
    leaks = {
        key: values.get(key)
        for key in (
            "num_requests_running",
            "num_requests_waiting",
            "kv_cache_usage_perc",
            "frontend_requests_in_flight",
        )
        if values.get(key) != 0
    }
    growth = {name: rss_end.get(name, 0) - rss_start[name] for name in rss_start}
    slack = {name: max(args.rss_slack * rss_start[name], 64 << 20) for name in rss_start}
    checks = {
        "server alive": alive,
        "no leak": not leaks,
        "every outcome expected": all(
            outcome.split(":", 1)[1] in EXPECTED[outcome.split(":", 1)[0]]
            for outcome in books.outcomes
        ),
        "server ends = sub-requests": sum(finished.values()) == books.sub_requests,
        "rss bounded": all(growth[n] <= slack[n] for n in growth),
        "preemption exercised": values.get("num_preemptions_total", 0) > 0,
        "deadlines exercised": finished.get("timeout", 0) > 0,
    }
    return {
        "duration_s": round(elapsed, 1),
        "concurrency": args.concurrency,
        "requests_sent": sum(books.sent.values()),
        "sent_by_scenario": dict(books.sent),
        "outcomes": dict(sorted(books.outcomes.items())),
        "sub_requests": books.sub_requests,
        "server_finished_by_reason": finished,
        "preemptions": values.get("num_preemptions_total"),
        "leaks": leaks,
        "rss_start_mib": {n: round(v / 2**20, 1) for n, v in rss_start.items()},
        "rss_end_mib": {n: round(v / 2**20, 1) for n, v in rss_end.items()},
        "checks": checks,
        "ok": all(checks.values()),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="Seconds of traffic.")
    parser.add_argument("--concurrency", type=int, default=8, help="Concurrent clients.")
    # 24 MiB holds 544 tokens of the embedded model: two long requests at once preempt.
    parser.add_argument("--kv-bytes", type=int, default=24 << 20, help="KV cache size.")
    parser.add_argument("--rss-slack", type=float, default=0.25, help="Allowed RSS growth.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="Write the figures here.")
    args = parser.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
