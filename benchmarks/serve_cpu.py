"""The cost of the process split and HTTP: served throughput against offline generation.

The same random-token prompts, greedy, ignore EOS, run (1) through `kvflow serve` by N
concurrent streaming clients and (2) offline through `LLM.generate`, one after the other
on the same machine. Writes JSON; prints a short table last.

    python benchmarks/serve_cpu.py --num-prompts 64 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import openai
import torch

from kvflow import LLM, SamplingParams

# The e2e tests' server helper starts `kvflow serve` exactly as the tests do.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.e2e.server import API_KEY, start_server


def make_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 49152, (num, length), generator=generator).tolist()


async def one_stream(client: openai.AsyncOpenAI, prompt: list[int], output_len: int) -> dict:
    start = time.perf_counter()
    stamps: list[float] = []
    stream = await client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=prompt,
        max_tokens=output_len,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft": stamps[0] - start, "itl": gaps, "end": stamps[-1]}


def run_served(prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    server = start_server("--max-model-len", "2048")
    try:

        async def run_all(batch: list[list[int]]) -> list[dict]:
            # One client per event loop: its connections belong to the loop that made them.
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
            limit = asyncio.Semaphore(concurrency)

            async def limited(prompt: list[int]) -> dict:
                async with limit:
                    return await one_stream(client, prompt, output_len)

            return await asyncio.gather(*(limited(p) for p in batch))

        asyncio.run(run_all(prompts[:2]))  # warm-up
        start = time.perf_counter()
        results = asyncio.run(run_all(prompts))
        elapsed = time.perf_counter() - start
    finally:
        server.stop()
    itl = sorted(g for r in results for g in r["itl"])
    ttft = sorted(r["ttft"] for r in results)
    return {
        "system": f"kvflow serve ({concurrency} concurrent streams over HTTP)",
        "seconds": round(elapsed, 3),
        "output_tok_per_s": round(len(prompts) * output_len / elapsed, 1),
        "ttft_p50_ms": round(1000 * statistics.median(ttft), 1),
        "ttft_p99_ms": round(1000 * ttft[int(0.99 * (len(ttft) - 1))], 1),
        "itl_p50_ms": round(1000 * statistics.median(itl), 1),
        "itl_p99_ms": round(1000 * itl[int(0.99 * (len(itl) - 1))], 1),
    }


def run_offline(prompts: list[list[int]], output_len: int) -> dict:
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
    parser.add_argument("--out", default="benchmarks/results/serve_cpu.json")
    args = parser.parse_args()

    prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
    served = run_served(prompts, args.output_len, args.concurrency)
    offline = run_offline(prompts, args.output_len)
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
