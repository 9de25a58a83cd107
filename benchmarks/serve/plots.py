"""PNG plots of serving runs: latency CDFs, throughput and queues over time, latency by rate."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI

import matplotlib.pyplot as plt

from benchmarks.serve.flags import METRICS
from benchmarks.serve.metrics import METRIC_NAMES, percentile, samples
from benchmarks.serve.runner import Run


def rate_label(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:g} req/s"


def latency_cdfs(runs: list[Run], path: Path, labels: list[str] | None = None) -> None:
    """One panel per metric, one line per run (labelled by its rate unless `labels`)."""
    labels = labels or [rate_label(run.request_rate) for run in runs]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, name in zip(axes.flat, METRICS, strict=True):
        for run, label in zip(runs, labels, strict=True):
            values = sorted(v * 1000 for v in samples(run.results)[name])
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                axis.plot(values, fractions, label=label)
        axis.set(title=METRIC_NAMES[name], xlabel="ms", ylabel="fraction of samples")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def output_rate(run: Run, bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Output tokens per second in bins of the run's time; a request's tokens are spread
    evenly over its chunks (a chunk may carry several)."""
    num_bins = max(1, math.ceil(run.duration / bin_s))
    counts = [0.0] * num_bins
    for result in run.results:
        if not result.chunk_times or not result.completion_tokens:
            continue
        weight = result.completion_tokens / len(result.chunk_times)
        offset = result.start - run.origin
        for t in result.chunk_times:
            counts[min(num_bins - 1, int((offset + t) / bin_s))] += weight
    return [(i + 0.5) * bin_s for i in range(num_bins)], [c / bin_s for c in counts]


def in_flight(run: Run) -> tuple[list[float], list[int]]:
    """Requests between send and end at the client, as a step function of time."""
    events = sorted(
        [(r.start - run.origin, 1) for r in run.results]
        + [(r.start - run.origin + r.latency, -1) for r in run.results]
    )
    times, counts, now = [0.0], [0], 0
    for t, delta in events:
        now += delta
        times.append(t)
        counts.append(now)
    return times, counts


def timeline(run: Run, path: Path) -> None:
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    top.plot(*output_rate(run), color="tab:blue")
    top.set(ylabel="output tokens/s", title=f"Throughput over time, {rate_label(run.request_rate)}")
    top.grid(alpha=0.3)
    bottom.step(*in_flight(run), where="post", label="in flight (client)", color="tab:gray")
    if run.server_samples:
        t = [s["t"] for s in run.server_samples]
        for key, color in (("running", "tab:green"), ("waiting", "tab:red")):
            if key in run.server_samples[0]:
                values = [s.get(key, 0.0) for s in run.server_samples]
                bottom.plot(t, values, label=f"{key} (server)", color=color)
    else:
        bottom.set_title(f"server gauges unavailable: {run.monitor_problem}", fontsize="small")
    bottom.set(xlabel="seconds since the run started", ylabel="requests")
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def latency_by_rate(runs: list[Run], path: Path) -> None:
    finite = sorted(
        (r for r in runs if not math.isinf(r.request_rate)), key=lambda r: r.request_rate
    )
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, name in zip(axes, ("ttft", "tpot"), strict=True):
        rates = [r.request_rate for r in finite]
        for p, style in ((50, "o-"), (99, "s--")):
            values = [
                percentile([v * 1000 for v in vals], p) if (vals := samples(r.results)[name]) else 0
                for r in finite
            ]
            axis.plot(rates, values, style, label=f"p{p}")
        axis.set(title=METRIC_NAMES[name], xlabel="request rate (req/s)", ylabel="ms")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def draw_all(runs: list[Run], directory: Path) -> list[Path]:
    """Every plot for `runs` into `directory`; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / "latency_cdf.png"]
    latency_cdfs(runs, written[0])
    for run in runs:
        name = "inf" if math.isinf(run.request_rate) else f"{run.request_rate:g}"
        path = directory / f"timeline_rate-{name}.png"
        timeline(run, path)
        written.append(path)
    if sum(not math.isinf(r.request_rate) for r in runs) >= 2:
        written.append(directory / "latency_by_rate.png")
        latency_by_rate(runs, written[-1])
    return written
