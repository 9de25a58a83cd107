"""Send a dataset's requests at a request rate and gather what the client and server saw."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.serve.client import (
    EMBEDDINGS,
    RequestResult,
    embed_request,
    request_body,
    stream_request,
)
from benchmarks.serve.datasets import SampleRequest
from benchmarks.serve.monitor import ServerMonitor


@dataclass(frozen=True)
class Target:
    """Where requests go and how they are shaped."""

    base_url: str  # http://host:port, no /v1
    endpoint: str  # /v1/completions or /v1/chat/completions
    model: str
    headers: dict[str, str]
    ignore_eos: bool
    extra_body: dict[str, Any] = field(default_factory=dict)  # sampling fields (temperature..)

    def body(self, request: SampleRequest) -> dict[str, Any]:
        return request_body(
            self.endpoint,
            self.model,
            request.prompt,
            request.output_len,
            self.ignore_eos,
            self.extra_body,
        )


@dataclass
class Run:
    """One request rate's results; times in seconds from the run's start."""

    request_rate: float
    results: list[RequestResult]
    origin: float  # perf_counter at the run's start
    duration: float
    server_samples: list[dict[str, float]]
    monitor_problem: str


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each request: gamma-distributed with mean 1/rate (burstiness 1 = Poisson;
    lower is burstier, higher steadier); all zero for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(num)]


def session() -> aiohttp.ClientSession:
    # No connection cap (the benchmark's own --max-concurrency limits), no total timeout.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
    )


async def run_requests(
    target: Target,
    requests: list[SampleRequest],
    rate: float,
    burstiness: float,
    max_concurrency: int | None,
    seed: int,
    progress: Callable[[str], None] | None = None,
    monitor_interval: float = 0.5,
) -> Run:
    """Send `requests` at `rate` per second (inf: all at once), at most `max_concurrency` in
    flight, while a monitor scrapes /metrics; returns when every stream has ended."""
    url = target.base_url + target.endpoint
    send = embed_request if target.endpoint == EMBEDDINGS else stream_request
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    done: list[RequestResult] = []

    async with session() as http:

        async def one(request: SampleRequest) -> RequestResult:
            async with limit:
                result = await send(http, url, target.body(request), target.headers)
            done.append(result)
            return result

        origin = time.perf_counter()
        monitor = ServerMonitor(
            target.base_url + "/metrics", target.headers, origin, monitor_interval
        )
        stop = asyncio.Event()
        watchers = [asyncio.create_task(monitor.run(http, stop))]
        if progress is not None:
            watchers.append(asyncio.create_task(_report(progress, done, len(requests), stop)))
        tasks = []
        # Each send at its own time from the start, so late wake-ups (the loop also reads
        # every stream) do not add up into a lower rate; the first goes at once.
        send_at = itertools.accumulate(arrival_gaps(len(requests), rate, burstiness, seed)[:-1])
        for request, offset in zip(requests, itertools.chain([0.0], send_at), strict=True):
            delay = origin + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - origin
        stop.set()
        await asyncio.gather(*watchers)
    return Run(rate, results, origin, duration, monitor.samples, monitor.problem)


async def _report(
    progress: Callable[[str], None],
    done: list[RequestResult],
    total: int,
    stop: asyncio.Event,
    every: float = 5.0,
) -> None:
    start = time.perf_counter()
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            failed = sum(not r.success for r in done)
            elapsed = time.perf_counter() - start
            progress(f"  {len(done)}/{total} done, {failed} failed, {elapsed:.0f} s")


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
