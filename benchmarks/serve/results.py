"""The result file `vllm bench serve --save-result` writes, written the same way: its name,
its folder, and its keys where kvflow measures the same thing.

vLLM names it `{label}-{request_rate}qps[-concurrency{N}]-{model}-{YYYYMMDD-HHMMSS}.json`
(the label defaults to the backend, the rate is written as a float, `inf` when unbounded, the
model is the last part of its id) in `--result-dir`, or `--result-filename` instead. kvflow
writes one such file for each rate of `--request-rate`. Keys that vLLM's file holds and kvflow
does not measure are left out: `max_output_tokens_per_s`, `max_concurrent_requests`, `rtfx`,
and, with `--save-detailed`, `generated_texts` and `queue_times`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path
from typing import Any

from benchmarks.serve.client import RequestResult

# The run's figures under the names vLLM's file gives them (kvflow's summary: vLLM's).
_SUMMARY_KEYS = {
    "duration_s": "duration",
    "completed": "completed",
    "failed": "failed",
    "total_input_tokens": "total_input_tokens",
    "total_output_tokens": "total_output_tokens",
    "request_throughput": "request_throughput",
    "output_throughput": "output_throughput",
    "total_token_throughput": "total_token_throughput",
}
_LATENCY_PREFIXES = ("mean_", "median_", "std_", "p")


def timestamp(now: datetime.datetime | None = None) -> str:
    """vLLM's `date` and file name stamp: local time, YYYYMMDD-HHMMSS."""
    return (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")


def file_name(
    label: str, rate: float, max_concurrency: int | None, model_id: str, stamp: str
) -> str:
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    base_model = model_id.split("/")[-1]
    return f"{label}-{float(rate)}qps{concurrency}-{base_model}-{stamp}.json"


def result_path(args: argparse.Namespace, model_id: str, rate: float, stamp: str) -> Path:
    """Where `--save-result` writes the run at `rate` (creating --result-dir)."""
    label = args.label or args.backend
    name = args.result_filename or file_name(label, rate, args.max_concurrency, model_id, stamp)
    if args.result_dir is None:
        return Path(name)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    return Path(args.result_dir) / name


def result_record(
    args: argparse.Namespace,
    stamp: str,
    model_id: str,
    rate: float,
    summary: dict[str, Any],
    results: list[RequestResult] | None = None,
) -> dict[str, Any]:
    """vLLM's keys, in its order: the setup, --metadata, the traffic, then the figures;
    every request's timings too when `results` are given (--save-detailed)."""
    record: dict[str, Any] = {
        "date": stamp,
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": args.tokenizer,
        "num_prompts": args.num_prompts,
        **dict(args.metadata),
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }
    record.update({ours: summary[theirs] for theirs, ours in _SUMMARY_KEYS.items()})
    goodput = summary.get("goodput")
    record["request_goodput"] = goodput["request_goodput"] if goodput else None
    record.update(
        (key, value)
        for key, value in summary.items()
        if key.startswith(_LATENCY_PREFIXES) and key.endswith("_ms")
    )
    if results is not None:
        record.update(detailed(results))
    return record


def detailed(results: list[RequestResult]) -> dict[str, list[Any]]:
    """Per request, in send order, as vLLM's lists: lengths in tokens, times in seconds."""
    ordered = sorted(results, key=lambda r: r.start)
    return {
        "input_lens": [r.prompt_tokens for r in ordered],
        "output_lens": [r.completion_tokens for r in ordered],
        "ttfts": [r.ttft for r in ordered],
        "itls": [r.itl for r in ordered],
        "latencies": [r.latency for r in ordered],
        "start_times": [r.start for r in ordered],
        "errors": [r.error for r in ordered],
    }


def write_result(path: Path, record: dict[str, Any], append: bool) -> None:
    """One JSON object; with `append`, after what the file holds, a newline between (vLLM's
    --append-result)."""
    with path.open("a+" if append else "w", encoding="utf-8") as out:
        if append and out.tell() != 0:
            out.write("\n")
        json.dump(record, out)
