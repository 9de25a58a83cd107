"""`kvflow bench serve`'s parts that need no server: datasets, arrivals, metrics, gauges."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from benchmarks.serve.client import RequestResult, request_body
from benchmarks.serve.datasets import (
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from benchmarks.serve.flags import Slo, parse_percentiles, parse_rates
from benchmarks.serve.metrics import percentile, summarize
from benchmarks.serve.monitor import parse_gauges
from benchmarks.serve.runner import arrival_gaps


def test_random_requests_have_their_lengths_and_differ_by_seed() -> None:
    requests = random_requests(50, 100, 20, 0.5, seed=1, vocab_bound=500)
    assert all(50 <= len(r.prompt) <= 150 and r.prompt_len == len(r.prompt) for r in requests)
    assert all(10 <= r.output_len <= 30 for r in requests)
    assert all(100 <= t < 500 for r in requests for t in r.prompt)  # type: ignore[union-attr]
    assert random_requests(50, 100, 20, 0.5, seed=1, vocab_bound=500) == requests
    assert random_requests(50, 100, 20, 0.5, seed=2, vocab_bound=500) != requests


def test_prefix_repetition_shares_prefixes() -> None:
    requests = prefix_repetition_requests(12, 30, 5, 3, 7, seed=0)
    prefixes = {tuple(r.prompt[:30]) for r in requests}
    assert len(prefixes) == 3
    assert all(len(r.prompt) == 35 and r.output_len == 7 for r in requests)
    assert len({tuple(r.prompt[30:]) for r in requests}) == 12


def test_sharegpt_takes_first_exchanges(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    conversations = [
        {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Yo"}]},
        {
            "conversations": [
                {"from": "gpt", "value": "no human first"},
                {"from": "human", "value": "x"},
            ]
        },
        {"conversations": [{"from": "human", "value": "alone"}]},
        {"id": "no conversations"},
    ]
    path.write_text(json.dumps(conversations))
    requests = sharegpt_requests(path, 3, seed=0, tokenizer=None, output_len=9)
    assert [r.prompt for r in requests] == ["Hi there"] * 3
    assert all(r.output_len == 9 and r.prompt_len is None for r in requests)
    with pytest.raises(ValueError, match="--tokenizer or --sharegpt-output-len"):
        sharegpt_requests(path, 3, seed=0, tokenizer=None, output_len=None)


def test_chat_needs_text_prompts() -> None:
    body = request_body("/v1/chat/completions", "m", "hello", 5, True, {"temperature": 0})
    assert body["messages"] == [{"role": "user", "content": "hello"}]
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    with pytest.raises(ValueError, match="text prompts"):
        request_body("/v1/chat/completions", "m", [1, 2], 5, False, {})


def test_arrivals_are_poisson_at_the_rate() -> None:
    gaps = arrival_gaps(20000, rate=16.0, burstiness=1.0, seed=0)
    assert statistics.fmean(gaps) == pytest.approx(1 / 16, rel=0.03)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 16, rel=0.05)  # exponential: sd = mean
    steady = arrival_gaps(20000, rate=16.0, burstiness=4.0, seed=0)
    assert statistics.pstdev(steady) == pytest.approx(1 / 32, rel=0.05)  # gamma: mean / sqrt(k)
    assert arrival_gaps(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]


def test_rates_and_slos_parse_or_say_why() -> None:
    assert parse_rates("4,16,inf") == [4.0, 16.0, math.inf]
    for bad in ("0", "-1", "fast", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rates(bad)
    assert parse_percentiles("50,99.9") == [50.0, 99.9]
    for bad in ("101", "-1", "p99"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_percentiles(bad)
    assert Slo.parse("ttft:200") == Slo("ttft", 200.0)
    for bad in ("itl:5", "ttft", "ttft:-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            Slo.parse(bad)


def test_percentile_matches_numpy() -> None:
    values = [5.0, 1.0, 9.0, 2.0, 7.5, 3.0]
    for p in (0, 25, 50, 90, 99, 100):
        assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))


def result(ttft: float, latency: float, tokens: int, success: bool = True) -> RequestResult:
    times = [ttft + i * (latency - ttft) / max(1, tokens - 1) for i in range(tokens)]
    return RequestResult(
        output_len=tokens,
        success=success,
        error="" if success else "HTTP 500: boom",
        ttft=ttft,
        latency=latency,
        chunk_times=times,
        prompt_tokens=10,
        completion_tokens=tokens,
    )


def test_summary_counts_tokens_and_goodput() -> None:
    results = [result(0.1, 1.0, 10), result(0.3, 2.1, 10), result(0, 0, 0, success=False)]
    summary = summarize(results, 4.0, [50, 99], [Slo("ttft", 200), Slo("tpot", 150)])
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["total_output_tokens"] == 20 and summary["total_input_tokens"] == 20
    assert summary["request_throughput"] == 0.5 and summary["output_throughput"] == 5.0
    assert summary["median_ttft_ms"] == pytest.approx(200)
    assert summary["mean_tpot_ms"] == pytest.approx((100 + 200) / 2)
    assert summary["median_itl_ms"] == pytest.approx(150)  # 9 gaps of 100, 9 of 200
    assert summary["goodput"]["good_requests"] == 1  # the second misses both objectives
    assert summary["errors"] == ["HTTP 500: boom"]


def test_gauges_from_any_engines_metrics_page() -> None:
    page = "\n".join(
        [
            "# HELP vllm:num_requests_running Number of requests running.",
            'vllm:num_requests_running{model_name="a"} 3.0',
            'vllm:num_requests_running{model_name="b"} 2.0',
            'vllm:num_requests_waiting{model_name="a"} 7.0',
            "kvflow:kv_cache_usage_perc 0.25",
            'vllm:time_to_first_token_seconds_bucket{le="0.1"} 4.0',
        ]
    )
    assert parse_gauges(page) == {"running": 5.0, "waiting": 7.0, "kv_usage": 0.25}
