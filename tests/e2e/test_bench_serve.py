"""`kvflow bench serve` against a real `kvflow serve`: the JSON's contents agree with what
was asked and with each other, and the plots are written. Never timings."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server import API_KEY, Server, start_server

pytestmark = pytest.mark.slow
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    server = start_server()
    yield server
    server.stop()


def bench(server: Server, out: Path, *flags: str) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services",
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--api-key",
            API_KEY,
            "--output-json",
            str(out),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, report, proc.stdout + proc.stderr


def test_random_dataset_at_two_rates(server: Server, tmp_path: Path) -> None:
    plots = tmp_path / "plots"
    code, report, output = bench(
        server,
        tmp_path / "random.json",
        "--num-prompts", "6",
        "--random-input-len", "24",
        "--random-output-len", "8",
        "--ignore-eos",
        "--temperature", "0",
        "--request-rate", "8,inf",
        "--max-concurrency", "3",
        "--goodput", "ttft:600000", "e2el:600000",
        "--save-detailed",
        "--plot", str(plots),
    )  # fmt: skip
    assert code == 0, output
    assert "Serving Benchmark Result" in output and "Successful requests:" in output
    assert report["model"] == "SmolLM2-135M-Instruct" and report["ignore_eos"]
    assert [run["request_rate"] for run in report["runs"]] == [8.0, "inf"]
    for run in report["runs"]:
        assert (run["completed"], run["failed"]) == (6, 0)
        assert run["total_output_tokens"] == 6 * 8  # ignore_eos: every max_tokens
        assert run["total_input_tokens"] == 6 * 24  # token-id prompts: exact lengths
        assert run["goodput"]["good_requests"] == 6  # objectives no request can miss
        requests = run["requests"]
        assert all(r["completion_tokens"] == 8 and r["success"] for r in requests)
        assert all(len(r["chunk_times"]) >= 1 for r in requests)
        assert run["server_samples"] and {"running", "waiting"} <= set(run["server_samples"][0])
        assert max(s["running"] for s in run["server_samples"]) <= 3  # --max-concurrency
    for name in ("latency_cdf.png", "timeline_rate-8.png", "timeline_rate-inf.png"):
        assert (plots / name).read_bytes().startswith(PNG_SIGNATURE), name
    server.wait_idle()


def test_a_vllm_command_line_writes_vllms_result_file(server: Server, tmp_path: Path) -> None:
    results = tmp_path / "results"
    code, report, output = bench(
        server,
        tmp_path / "kvflow.json",
        "--backend", "vllm",
        "--dataset-name", "random",
        "--random-input-len", "16",
        "--random-output-len", "4",
        "--num-prompts", "3",
        "--request-rate", "inf",
        "--max-concurrency", "2",
        "--ignore-eos",
        "--save-result",
        "--result-dir", str(results),
        "--label", "kv",
        "--metadata", "device=cpu", "run=e2e",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
    )  # fmt: skip
    assert code == 0, output
    (path,) = results.iterdir()
    name = r"kv-infqps-concurrency2-SmolLM2-135M-Instruct-\d{8}-\d{6}\.json"
    assert re.fullmatch(name, path.name), path.name
    record = json.loads(path.read_text())
    assert (record["backend"], record["label"], record["request_rate"]) == ("vllm", "kv", "inf")
    assert (record["device"], record["run"]) == ("cpu", "e2e")
    assert (record["completed"], record["failed"], record["total_output_tokens"]) == (3, 0, 12)
    assert {f"p{p}_{m}_ms" for p in (50, 99) for m in ("ttft", "tpot", "itl", "e2el")} <= set(
        record
    )
    assert report["runs"][0]["result_file"] == str(path)
    server.wait_idle()


def test_chat_with_a_sharegpt_file_and_shared_prefixes(server: Server, tmp_path: Path) -> None:
    conversations = [
        {"conversations": [{"from": "human", "value": f"Tell me about {topic}."},
                           {"from": "gpt", "value": "Sure."}]}
        for topic in ("rivers", "bread", "clocks")
    ]  # fmt: skip
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    code, report, output = bench(
        server,
        tmp_path / "chat.json",
        "--endpoint", "/v1/chat/completions",
        "--dataset-name", "sharegpt",
        "--dataset-path", str(dataset),
        "--sharegpt-output-len", "5",
        "--num-prompts", "4",
        "--ignore-eos",
    )  # fmt: skip
    assert code == 0, output
    (run,) = report["runs"]
    assert (run["completed"], run["total_output_tokens"]) == (4, 20)
    assert run["total_input_tokens"] > 4 * 5  # the chat template's tokens and the question

    hits_before = server.metrics()["prefix_cache_hits_total"]
    code, report, output = bench(
        server,
        tmp_path / "prefix.json",
        "--dataset-name", "prefix-repetition",
        "--prefix-repetition-prefix-len", "64",
        "--prefix-repetition-suffix-len", "8",
        "--prefix-repetition-num-prefixes", "2",
        "--prefix-repetition-output-len", "4",
        "--num-prompts", "6",
        "--max-concurrency", "1",
        "--ignore-eos",
    )  # fmt: skip
    assert code == 0, output
    (run,) = report["runs"]
    assert (run["completed"], run["total_input_tokens"]) == (6, 6 * 72)
    hits = server.metrics()["prefix_cache_hits_total"] - hits_before
    assert hits >= 4 * 64  # the prefixes after each one's first request (64 = 4 blocks)
    server.wait_idle()


def test_failures_are_counted_and_the_exit_code_says_so(server: Server, tmp_path: Path) -> None:
    code, report, output = bench(
        server,
        tmp_path / "too_long.json",
        "--num-prompts", "2",
        "--random-input-len", "900",
        "--random-output-len", "400",  # prompt + output past --max-model-len 1024
        "--num-warmups", "0",
    )  # fmt: skip
    assert code == 1, output
    (run,) = report["runs"]
    assert (run["completed"], run["failed"]) == (0, 2)
    assert run["errors"] and run["errors"][0].startswith("HTTP 400")
