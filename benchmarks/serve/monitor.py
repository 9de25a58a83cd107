"""The server's own view while a run goes: running and waiting requests and KV use, scraped
from its Prometheus /metrics (kvflow's `kvflow:` names mirror vLLM's `vllm:`)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field

import aiohttp

GAUGES = {
    "num_requests_running": "running",
    "num_requests_waiting": "waiting",
    "kv_cache_usage_perc": "kv_usage",
}
# `<prefix>:<name>{labels} value`: any engine's prefix, summed over label sets (e.g. models).
_LINE = re.compile(r"^\w+:(\w+)(?:\{[^}]*\})? ([-+0-9.eE]+|NaN)$")


def parse_gauges(text: str) -> dict[str, float]:
    """The gauges above from a Prometheus text page; a gauge the page lacks is left out."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None or match.group(1) not in GAUGES:
            continue
        key = GAUGES[match.group(1)]
        values[key] = values.get(key, 0.0) + float(match.group(2))
    return values


@dataclass
class ServerMonitor:
    """Polls `metrics_url` every `interval` seconds until stopped; samples carry seconds since
    `origin` (a perf_counter time) so they line up with the requests' timestamps."""

    metrics_url: str
    headers: dict[str, str]
    origin: float
    interval: float = 0.5
    samples: list[dict[str, float]] = field(default_factory=list)
    problem: str = ""  # why no samples came, if none did

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                async with session.get(self.metrics_url, headers=self.headers) as response:
                    if response.status != 200:
                        self.problem = f"/metrics answered HTTP {response.status}"
                        return
                    gauges = parse_gauges(await response.text())
            except aiohttp.ClientError as exc:
                self.problem = f"/metrics failed: {exc}"
                return
            if not gauges:
                self.problem = "/metrics has no running/waiting gauges"
                return
            self.samples.append({"t": time.perf_counter() - self.origin, **gauges})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)
