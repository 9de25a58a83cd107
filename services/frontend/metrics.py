"""Prometheus text exposition of kvflow's metrics; names mirror vLLM's with `kvflow:`."""

from __future__ import annotations

import bisect
from collections import Counter

from shared.protocol import StatsSnapshot

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class Histogram:
    def __init__(self, name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{{labels},le="{le}"}} {total}')
        lines.append(f"{self.name}_sum{{{labels}}} {self.sum}")
        lines.append(f"{self.name}_count{{{labels}}} {total}")
        return lines


class Metrics:
    """Request-level figures measured in the frontend, plus the scheduler's latest snapshot."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{model_name}"'
        self.ttft = Histogram("kvflow:time_to_first_token_seconds", "Time to first token.")
        self.itl = Histogram("kvflow:inter_token_latency_seconds", "Time between tokens.")
        self.e2e = Histogram("kvflow:e2e_request_latency_seconds", "End-to-end latency.")
        self.finished: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # requests refused up front, by reason

    def render(
        self, stats: StatsSnapshot | None, num_tokenizer_workers: int, num_in_flight: int
    ) -> str:
        lines = _sample(
            "kvflow:num_tokenizer_workers",
            "gauge",
            "Tokenizer workers taking requests (alive and not draining).",
            self.labels,
            num_tokenizer_workers,
        )
        lines += _sample(
            "kvflow:frontend_requests_in_flight",
            "gauge",
            "Requests this frontend has sent to the engine and not seen end (its own load).",
            self.labels,
            num_in_flight,
        )
        if stats is not None:
            gauges = {
                "num_requests_running": (stats.num_running, "Requests in the running batch."),
                "num_requests_waiting": (stats.num_waiting, "Requests waiting to be scheduled."),
                "num_prompt_tokens_waiting": (
                    stats.num_waiting_tokens,
                    "Tokens the waiting requests owe (bounded by --max-queued-tokens).",
                ),
                "kv_cache_usage_perc": (stats.kv_usage, "Fraction of KV blocks in use (0-1)."),
            }
            counters = {
                "prefix_cache_queries": (stats.prefix_cache_queries, "Prompt tokens looked up."),
                "prefix_cache_hits": (stats.prefix_cache_hits, "Prompt tokens found cached."),
                "num_preemptions": (stats.num_preemptions, "Preemptions by recompute."),
                "prompt_tokens": (stats.num_prompt_tokens, "Prompt tokens processed."),
                "generation_tokens": (stats.num_generation_tokens, "Tokens generated."),
                "device_busy_seconds": (
                    stats.device_busy_seconds,
                    "Seconds the device ran steps (its rate is the busy fraction; 0 on CPU).",
                ),
            }
            for name, (value, doc) in gauges.items():
                lines += _sample(f"kvflow:{name}", "gauge", doc, self.labels, value)
            for name, (value, doc) in counters.items():
                lines += _sample(f"kvflow:{name}_total", "counter", doc, self.labels, value)
        lines += [
            "# HELP kvflow:request_success_total Finished requests by reason.",
            "# TYPE kvflow:request_success_total counter",
        ]
        for reason in ("stop", "length", "abort", "error", "timeout"):
            lines.append(
                f'kvflow:request_success_total{{{self.labels},finished_reason="{reason}"}}'
                f" {self.finished[reason]}"
            )
        lines += [
            "# HELP kvflow:request_refused_total Requests refused (429) because the waiting"
            " queue was full.",
            "# TYPE kvflow:request_refused_total counter",
            f'kvflow:request_refused_total{{{self.labels},reason="queue_full"}}'
            f" {self.refused['queue_full']}",
        ]
        for histogram in (self.ttft, self.itl, self.e2e):
            lines += histogram.render(self.labels)
        return "\n".join(lines) + "\n"


def _sample(name: str, kind: str, doc: str, labels: str, value: float) -> list[str]:
    return [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"]
