"""`kvflow bench serve`'s parts that need no server: datasets, arrivals, metrics, gauges,
the flags of `vllm bench serve`'s command lines, and vLLM's result file."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import statistics
from pathlib import Path

import numpy as np
import pytest

from benchmarks.serve.bench import make_requests
from benchmarks.serve.checks import check_serve_args
from benchmarks.serve.client import RequestResult, request_body
from benchmarks.serve.datasets import (
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from benchmarks.serve.flags import (
    REFUSED,
    Slo,
    add_serve_flags,
    parse_percentiles,
    parse_rates,
    percentile_key,
)
from benchmarks.serve.metrics import format_table, percentile, summarize
from benchmarks.serve.monitor import parse_gauges
from benchmarks.serve.results import (
    file_name,
    result_path,
    result_record,
    timestamp,
    write_result,
)
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


# `vllm bench serve`'s command lines: parsed, checked, refused where kvflow cannot honour them.

VLLM_LINE = (
    "--backend vllm --model meta-llama/Llama-3.1-8B-Instruct --endpoint /v1/completions"
    " --dataset-name random --random-input-len 200 --random-output-len 200"
    " --random-range-ratio 0.1 --num-prompts 500 --request-rate 16 --burstiness 1.0"
    " --max-concurrency 64 --ignore-eos --seed 7 --save-result --result-dir out"
    " --result-filename run.json --label kv --metadata gpu=h200 note=a=b"
    " --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 25,50,99"
    " --save-detailed --append-result --served-model-name llama --tokenizer /tmp/tok"
    " --tokenizer-mode auto --temperature 0 --top-p 1 --min-p 0 --repetition-penalty 1"
)


def serve_args(line: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvflow bench serve")
    add_serve_flags(parser)
    args = parser.parse_args(shlex.split(line))
    check_serve_args(args)
    return args


def refusal(line: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as raised:
        serve_args(line)
    return f"{raised.value.code} {capsys.readouterr().err}"


EMBED = "--backend openai-embeddings --endpoint /v1/embeddings"


def test_an_embedding_run_measures_latency_and_batches_prompts() -> None:
    args = serve_args(f"{EMBED} --random-input-len 8 --random-batch-size 3 --num-prompts 7")
    assert args.percentile_metrics == ["e2el"] and args.random_batch_size == 3
    requests = make_requests(args, args.num_prompts, 0, None)
    assert [len(r.prompt) for r in requests] == [3, 3, 1]  # 7 prompts in requests of 3
    assert [r.prompt_len for r in requests] == [24, 24, 8]
    singles = random_requests(7, 8, 128, 0.0, seed=0)
    assert [p for r in requests for p in r.prompt] == [r.prompt for r in singles]
    body = request_body("/v1/embeddings", "m", requests[0].prompt, 0, False, {})
    assert body == {"model": "m", "input": requests[0].prompt}  # no max_tokens, no stream


def test_a_vllm_command_line_parses_to_what_it_says() -> None:
    args = serve_args(VLLM_LINE)
    assert (args.backend, args.model, args.served_model_name) == (
        "vllm",
        "meta-llama/Llama-3.1-8B-Instruct",
        "llama",
    )
    assert (args.random_input_len, args.random_output_len, args.random_range_ratio) == (
        200,
        200,
        0.1,
    )
    assert args.random_prefix_len == 0  # the dataset's defaults filled in
    assert args.request_rate == [16.0] and args.burstiness == 1.0 and args.max_concurrency == 64
    assert args.save_result and args.append_result and args.save_detailed
    assert (args.result_dir, args.result_filename, args.label) == (Path("out"), "run.json", "kv")
    assert args.metadata == [("gpu", "h200"), ("note", "a=b")]
    assert args.percentile_metrics == ["ttft", "tpot", "itl", "e2el"]
    assert args.metric_percentiles == [25.0, 50.0, 99.0]


def test_defaults_are_vllms() -> None:
    args = serve_args("")
    assert (args.backend, args.dataset_name, args.num_prompts, args.seed) == (
        "openai",
        "random",
        1000,
        0,
    )
    assert (args.random_input_len, args.random_output_len, args.random_range_ratio) == (
        1024,
        128,
        0.0,
    )
    assert args.request_rate == [math.inf] and args.burstiness == 1.0
    assert args.metric_percentiles == [99.0] and args.label is None
    assert not (args.save_result or args.append_result or args.save_detailed)


def test_general_lengths_and_vllms_dataset_spelling() -> None:
    args = serve_args("--input-len 64 --output-len 8")
    assert (args.random_input_len, args.random_output_len) == (64, 8)
    args = serve_args("--dataset-name prefix_repetition --output-len 9")
    assert args.dataset_name == "prefix-repetition"
    assert args.prefix_repetition_output_len == 9 and args.prefix_repetition_prefix_len == 256
    check_serve_args(args)  # a second check changes nothing
    assert args.prefix_repetition_output_len == 9


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_vllm_flags_kvflow_cannot_honour_are_refused_by_name(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    said = refusal(f"{flag} 1", capsys)
    assert said.startswith("2 ") and f"{flag} (a vllm bench serve flag) is not supported" in said


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("--dataset-path d.json", "--dataset-path is a sharegpt dataset flag"),
        ("--dataset-name sharegpt --dataset-path d.json --random-input-len 5", "random dataset"),
        ("--dataset-name sharegpt --dataset-path d.json --input-len 5", "--input-len has no"),
        ("--input-len 5 --random-input-len 6", "not both"),
        ("--dataset-name sharegpt", "needs --dataset-path"),
        ("--endpoint /v1/chat/completions", "needs text prompts"),
        ("--backend openai-chat", "--backend openai-chat needs --endpoint /v1/chat/completions"),
        ("--burstiness 2", "every rate here is inf"),
        ("--request-rate 4 --burstiness 0", "must be positive"),
        ("--max-concurrency 0", "must be positive"),
        ("--tokenizer-mode hf", "--tokenizer-mode needs --tokenizer"),
        ("--trust-remote-code", "--trust-remote-code needs --tokenizer"),
        ("--tokenizer t --skip-tokenizer-init", "contradict"),
        ("--result-dir out", "--result-dir names or fills the result file: add --save-result"),
        ("--label kv", "add --save-result"),
        ("--metadata a=b", "add --save-result"),
        ("--result-filename r.json", "add --save-result"),
        ("--save-detailed", "--save-detailed needs --save-result or --output-json"),
        ("--save-result --result-filename r.json --request-rate 4,inf", "--append-result"),
        ("--endpoint /v1/embeddings", "needs --backend openai-embeddings"),
        ("--backend openai-embeddings", "needs --endpoint /v1/embeddings"),
        ("--random-batch-size 4", "--backend openai-embeddings"),
        (f"{EMBED} --ignore-eos", "--ignore-eos shapes generated tokens"),
        (f"{EMBED} --output-len 4", "--random-output-len shapes generated tokens"),
        (f"{EMBED} --temperature 0", "--temperature shapes generated tokens"),
        (f"{EMBED} --percentile-metrics ttft,e2el", "ttft is not measured"),
        (f"{EMBED} --goodput tpot:10", "tpot is not measured"),
        (f"{EMBED} --random-batch-size 0", "at least 1"),
    ],
)
def test_flags_that_would_do_nothing_are_refused(
    line: str, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert reason in refusal(line, capsys)


@pytest.mark.parametrize(
    "line",
    [
        "--backend tgi",
        "--dataset-name sonnet",
        "--tokenizer t --tokenizer-mode mistral",
        "--percentile-metrics ttft,client_queue_time",
        "--metadata novalue",
        "--header novalue",
    ],
)
def test_values_kvflow_cannot_take_are_refused(
    line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    said = refusal(line, capsys)
    assert said.startswith("2 ") and line.split()[-2] in said


def test_percentile_keys_are_written_as_vllm_writes_them() -> None:
    assert [percentile_key(p) for p in (99.0, 50, 99.9, 0.5)] == ["99", "50", "99.9", "0.5"]
    results = [result(0.1, 1.0, 10), result(0.3, 2.1, 10)]
    summary = summarize(results, 4.0, [50, 99.9], [], ["ttft", "e2el"])
    assert {"p50_ttft_ms", "p99.9_ttft_ms", "mean_e2el_ms", "std_e2el_ms"} <= set(summary)
    assert not any("tpot" in key or "itl" in key for key in summary)  # --percentile-metrics
    table = format_table("t", summary, [50, 99.9], ["ttft", "e2el"])
    assert "P99.9 TTFT (ms):" in table and "TPOT" not in table


def test_result_file_names_follow_vllm() -> None:
    stamp = timestamp(datetime.datetime(2026, 11, 28, 9, 5, 7))
    assert stamp == "20261128-090507"
    assert (
        file_name("openai", 16, None, "meta-llama/Llama-3.1-8B", stamp)
        == "openai-16.0qps-Llama-3.1-8B-20261128-090507.json"
    )
    assert (
        file_name("kv", math.inf, 32, "/tmp/qwen3-8b", stamp)
        == "kv-infqps-concurrency32-qwen3-8b-20261128-090507.json"
    )


def test_result_path_takes_the_label_dir_and_filename(tmp_path: Path) -> None:
    args = serve_args(f"--save-result --backend vllm --result-dir {tmp_path / 'r'}")
    path = result_path(args, "org/m", 4.0, "20261128-090507")
    assert path == tmp_path / "r" / "vllm-4.0qps-m-20261128-090507.json"
    assert path.parent.is_dir()  # made
    args = serve_args("--save-result --label kv --max-concurrency 8")
    assert result_path(args, "m", 4.0, "S") == Path("kv-4.0qps-concurrency8-m-S.json")
    args = serve_args(f"--save-result --result-filename x.json --result-dir {tmp_path}")
    assert result_path(args, "m", 4.0, "S") == tmp_path / "x.json"


def test_the_result_record_has_vllms_keys_and_the_metadata() -> None:
    args = serve_args(
        "--save-result --save-detailed --backend vllm --label kv --tokenizer t"
        " --metadata gpu=h200 tp=2 --num-prompts 3 --max-concurrency 2 --goodput ttft:200"
    )
    results = [result(0.1, 1.0, 10), result(0.3, 2.1, 10), result(0, 0, 0, success=False)]
    for i, r in enumerate(results):
        r.start = 10.0 - i  # sent in the reverse of the list's order
    summary = summarize(results, 4.0, [99], args.goodput, args.percentile_metrics)
    record = result_record(args, "20261128-090507", "org/m", math.inf, summary, results)
    expected = {
        "date": "20261128-090507",
        "endpoint_type": "vllm",
        "backend": "vllm",
        "label": "kv",
        "model_id": "org/m",
        "tokenizer_id": "t",
        "num_prompts": 3,
        "gpu": "h200",
        "tp": "2",
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": 2,
        "duration": 4.0,
        "completed": 2,
        "failed": 1,
        "total_input_tokens": 20,
        "total_output_tokens": 20,
        "request_throughput": 0.5,
        "request_goodput": 0.25,
        "output_throughput": 5.0,
        "total_token_throughput": 10.0,
    }
    assert {key: record[key] for key in expected} == expected
    assert record["median_ttft_ms"] == pytest.approx(200) and "p99_e2el_ms" in record
    assert record["errors"] == ["HTTP 500: boom", "", ""]  # in send order
    assert record["output_lens"] == [0, 10, 10] and len(record["itls"][1]) == 9
    assert {"ttfts", "input_lens", "start_times", "latencies"} <= set(record)
    plain = result_record(args, "s", "m", 16.0, summary)
    assert plain["request_rate"] == 16.0 and "ttfts" not in plain and "errors" not in plain


def test_results_are_written_or_appended_a_line_each(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_result(path, {"a": 1}, append=False)
    write_result(path, {"a": 2}, append=False)
    assert json.loads(path.read_text()) == {"a": 2}
    write_result(path, {"a": 3}, append=True)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"a": 2}, {"a": 3}]


def test_random_prefix_and_sharegpt_order(tmp_path: Path) -> None:
    plain = random_requests(4, 10, 5, 0.0, seed=3, vocab_bound=500)
    shared = random_requests(4, 10, 5, 0.0, seed=3, vocab_bound=500, prefix_len=6)
    assert len({tuple(r.prompt[:6]) for r in shared}) == 1
    assert all(len(r.prompt) == 16 and r.prompt_len == 16 for r in shared)
    assert random_requests(4, 10, 5, 0.0, seed=3, vocab_bound=500, prefix_len=0) == plain
    path = tmp_path / "sharegpt.json"
    pairs = [f"q{i}" for i in range(5)]
    path.write_text(
        json.dumps(
            [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "a"}]}
             for q in pairs]
        )
    )  # fmt: skip
    in_order = sharegpt_requests(path, 7, 0, None, 3, shuffle=False)
    assert [r.prompt for r in in_order] == [*pairs, "q0", "q1"]
    assert len(sharegpt_requests(path, 7, 0, None, 3, oversample=False)) == 5
