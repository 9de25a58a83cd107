"""The cost of the process split and HTTP: served throughput against offline generation.

The same random-token prompts, greedy, ignore EOS, run (1) through `kvflow serve` by N
concurrent streaming clients and (2) offline through `LLM.generate`, one after the other
on the same machine. Writes JSON; prints a short table last.

    python -m sweeps.serve_cpu --num-prompts 64 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import time
from pathlib import Path

from benchmarks.serve.client import COMPLETIONS
from benchmarks.serve.datasets import SampleRequest, random_requests
from benchmarks.serve.metrics import summarize
from benchmarks.serve.runner import Target, run_requests
from kvflow import LLM, SamplingParams
from tests.e2e.server import start_server  # starts `kvflow serve` exactly as the tests do


def run_served(requests: list[SampleRequest], concurrency: int) -> dict:
    """The prompts through `kvflow serve`, measured by `kvflow bench serve`'s client."""
    server = start_server("--max-model-len", "2048")
    try:
        target = Target(
            base_url=server.url,
            endpoint=COMPLETIONS,  # token-id prompts
            model="SmolLM2-135M-Instruct",
            headers=server.headers(),
            ignore_eos=True,
            extra_body={"temperature": 0.0},
        )
        asyncio.run(run_requests(target, requests[:2], math.inf, 1.0, 2, seed=0))  # warm-up
        run = asyncio.run(run_requests(target, requests, math.inf, 1.0, concurrency, seed=0))
    finally:
        server.stop()
    summary = summarize(run.results, run.duration, [99], [])
    if summary["failed"]:
        raise SystemExit(f"served requests failed: {summary['errors']}")
    return {
        "system": f"kvflow serve ({concurrency} concurrent streams over HTTP)",
        "seconds": round(run.duration, 3),
        "output_tok_per_s": round(summary["output_throughput"], 1),
        "ttft_p50_ms": round(summary["median_ttft_ms"], 1),
        "ttft_p99_ms": round(summary["p99_ttft_ms"], 1),
        "itl_p50_ms": round(summary["median_itl_ms"], 1),
        "itl_p99_ms": round(summary["p99_itl_ms"], 1),
    }


def run_offline(requests: list[SampleRequest], output_len: int) -> dict:
    prompts = [list(r.prompt) for r in requests]
    llm = LLM(dtype="float32", device="cpu", max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return {
        "system": "kvflow generate (offline, one process)",
        "seconds": round(elapsed, 3),
        "output_tok_per_s": round(len(prompts) * output_len / elapsed, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        default=f"docs/results/{time.strftime('%Y-%m-%d')}-cpu-serve/serve_cpu.json",
        help="JSON path (default: a folder of today's date under docs/results/)",
    )
    args = parser.parse_args()

    # SmolLM2's vocabulary; lengths fixed (range ratio 0)
    requests = random_requests(
        args.num_prompts, args.input_len, args.output_len, 0.0, args.seed, vocab_bound=49152
    )
    served = run_served(requests, args.concurrency)
    offline = run_offline(requests, args.output_len)
    overhead = 1 - served["output_tok_per_s"] / offline["output_tok_per_s"]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "benchmark": "serve_cpu",
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        **vars(args),
        "runs": [served, offline],
        "serving_overhead": round(overhead, 4),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\n{'system':55} {'seconds':>8} {'out tok/s':>10}")
    for run in (served, offline):
        print(f"{run['system']:55} {run['seconds']:8.1f} {run['output_tok_per_s']:10.1f}")
    print(
        f"serving overhead: {100 * overhead:.1f} %  (TTFT p50 {served['ttft_p50_ms']} ms, "
        f"ITL p50 {served['itl_p50_ms']} ms, p99 {served['itl_p99_ms']} ms)"
    )


if __name__ == "__main__":
    main()
