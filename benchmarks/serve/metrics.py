"""A run's summary: throughput, latency distributions and goodput, from the client's view."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.serve.client import RequestResult
from benchmarks.serve.flags import METRICS, Slo, percentile_key

METRIC_NAMES = {
    "ttft": "Time to first token",
    "tpot": "Time per output token (excl. 1st)",
    "itl": "Inter-token latency",
    "e2el": "End-to-end latency",
}


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), of sorted or not."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def samples(results: list[RequestResult]) -> dict[str, list[float]]:
    """Each metric's values over the successful requests, in seconds."""
    done = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in done],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }


def _meets(result: RequestResult, slos: list[Slo]) -> bool:
    values = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return all(values[slo.metric] * 1000 <= slo.limit_ms for slo in slos)


def summarize(
    results: list[RequestResult],
    duration: float,
    percentiles: list[float],
    slos: list[Slo],
    metrics: Sequence[str] = METRICS,
) -> dict[str, Any]:
    """The figures of one run, of `metrics`' latencies (in milliseconds) only."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.completion_tokens for r in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    if slos:
        good = sum(_meets(r, slos) for r in done)
        summary["goodput"] = {
            "slos_ms": {slo.metric: slo.limit_ms for slo in slos},
            "good_requests": good,
            "request_goodput": good / duration,
        }
    values = samples(results)
    for name in metrics:
        ms = [v * 1000 for v in values[name]]
        summary[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else None
        summary[f"median_{name}_ms"] = statistics.median(ms) if ms else None
        summary[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else None
        for p in percentiles:
            summary[f"p{percentile_key(p)}_{name}_ms"] = percentile(ms, p) if ms else None
    errors = [r.error for r in results if not r.success]
    summary["errors"] = sorted(set(errors))[:10]
    return summary


def format_table(
    title: str,
    summary: dict[str, Any],
    percentiles: list[float],
    metrics: Sequence[str] = METRICS,
) -> str:
    """vLLM's bench serve layout, so the two read side by side."""
    lines = [f"{f' {title} ':=^60}"]

    def row(label: str, value: Any, fmt: str = "{:.2f}") -> None:
        text = "n/a" if value is None else fmt.format(value)
        lines.append(f"{label:<45}{text:>15}")

    row("Successful requests:", summary["completed"], "{}")
    row("Failed requests:", summary["failed"], "{}")
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"], "{}")
    row("Total generated tokens:", summary["total_output_tokens"], "{}")
    row("Request throughput (req/s):", summary["request_throughput"])
    if "goodput" in summary:
        row("Request goodput (req/s):", summary["goodput"]["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    for name in metrics:
        lines.append(f"{f' {METRIC_NAMES[name]} ':-^60}")
        row(f"Mean {name.upper()} (ms):", summary[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", summary[f"median_{name}_ms"])
        for p in percentiles:
            key = percentile_key(p)
            row(f"P{key} {name.upper()} (ms):", summary[f"p{key}_{name}_ms"])
    lines.extend(f"error: {e}" for e in summary["errors"])
    lines.append("=" * 60)
    return "\n".join(lines)
