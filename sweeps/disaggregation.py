"""Prefill/decode disaggregation: the transfer path and its cost, and what it buys.

Two servers of the same model, one after the other: a baseline, and two replicas, one
prefilling and one decoding (`--data-parallel-size 2 --prefill-replicas 1`), each KV cache held
to the same bytes. The baseline is one engine (`--baseline one`, for one GPU, which the two
replicas then share) or two ordinary replicas (`--baseline dp`: on two GPUs, a GPU each, as
the pair is). On each: a few greedy requests (their tokens must be the same on both), then
random-token prompts at a request rate, measured by `kvflow bench serve`'s client: all of
--input-len, or (`--long-fraction F`) a mix of long prompts (--long-len, spread by
--long-range) and short chats (--input-len). From the disaggregated server's metrics: the KV
blocks and bytes handed over and the decode executor's time fetching and copying them in,
against a pinned host-to-GPU copy measured beside it (the floor of the last leg of the path).
The disaggregated server runs once for each --kv-buffer-devices entry: the handed-over KV in
shared host memory (cpu), or in GPU memory that the decode replica copies by CUDA IPC (cuda).

    python -m sweeps.disaggregation /tmp/qwen3-8b --out $OUT/disaggregation.json
    python -m sweeps.disaggregation /tmp/qwen3-8b --baseline dp --long-fraction 0.25 \
        --long-len 10000 --long-range 0.6 --input-len 256 --max-model-len 20000 --out ...

MODEL is a folder with a tokenizer (the greedy tokens are compared as text pieces).

Needs a CUDA GPU with room for the model twice; some five minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.serve.client import COMPLETIONS
from benchmarks.serve.datasets import SampleRequest, random_requests
from benchmarks.serve.metrics import summarize
from benchmarks.serve.runner import Target, run_requests
from tests.e2e.server import Server, start_server

TRANSFER_METRICS = (
    "kv_transfer_blocks_exported_total",
    "kv_transfer_blocks_imported_total",
    "kv_transfer_bytes_imported_total",
    "kv_transfer_import_seconds_total",
    "kv_transfer_failed_imports_total",
)


def pinned_copy_gb_per_s(num_bytes: int = 1 << 30) -> float:
    """Host (pinned) to GPU copy bandwidth, the median of five."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del host, device
    torch.cuda.empty_cache()
    return num_bytes / sorted(times)[2] / 1e9


def transfer_path(num_blocks: int = 200) -> dict[str, Any]:
    """The executors' transfer alone, at Qwen3-8B's cache shape (36 layers, 8 KV heads of 128,
    bf16, 16-token blocks): `num_blocks` blocks exported and imported into another cache in
    this process, through the shared slots and as bytes over the socket; each way's seconds
    (the median of five) and whether the blocks arrived byte for byte."""
    import tempfile

    from services.executor.runner.host_kv import HostKVPool
    from services.executor.runner.kv_exports import KVExports
    from services.executor.runner.kv_imports import KVImports
    from shared.protocol import KVExport, KVImport
    from shared.wire_security import LOCAL

    def caches() -> list[torch.Tensor]:
        return [torch.randn(2, num_blocks, 16, 8, 128, device="cuda").bfloat16() for _ in range(36)]

    source, target = caches(), caches()
    folder = tempfile.mkdtemp()
    shared = f"/dev/shm/kvflow-kv-{os.getpid()}-sweep"
    # Twice the blocks: a release may come after the next export (as in serving, slots wait).
    pool = HostKVPool(source, 2 * num_blocks, shared)
    exports = KVExports(pool, f"ipc://{folder}/x", LOCAL, shared)
    order = list(range(num_blocks))
    result: dict[str, Any] = {
        "blocks": num_blocks,
        "bytes": HostKVPool(source, 0).block_bytes * num_blocks,
    }
    for way in ("shared", "bytes"):
        imports = KVImports(HostKVPool(target, 0), [f"ipc://{folder}/x"], LOCAL, way)
        if way == "bytes":
            imports._unshared.add(0)
        times = []
        for n in range(5):
            exports.add([KVExport(f"{way}{n}", order)])
            torch.cuda.synchronize()
            start = time.perf_counter()
            error = imports.load(KVImport(f"{way}{n}", 0, 0, order[::-1]))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            assert error is None, error
        same = all(torch.equal(s.flip(1), t) for s, t in zip(source, target, strict=True))
        result[way] = {"seconds": sorted(times)[2], "byte_for_byte": same}
    os.unlink(shared)
    return result


def greedy_tokens(server: Server, prompts: list[list[int]], max_tokens: int) -> list[list[str]]:
    outputs = []
    for prompt in prompts:
        body = {
            "model": "m",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
        }
        response = httpx.post(
            f"{server.url}/v1/completions", json=body, headers=server.headers(), timeout=120
        )
        response.raise_for_status()
        choice = response.json()["choices"][0]
        outputs.append(choice["logprobs"]["tokens"])
    return outputs


def replica_metrics(server: Server) -> dict[str, dict[str, float]]:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers()).text
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        for name in (*TRANSFER_METRICS, "prompt_tokens_total", "generation_tokens_total"):
            if line.startswith(f"kvflow:{name}{{"):
                replica = line.split('replica="')[1].split('"')[0]
                found.setdefault(name, {})[replica] = float(line.rsplit(" ", 1)[1])
    return found


def workload(args: argparse.Namespace) -> list[SampleRequest]:
    """The prompts, in a seeded order: short ones, and a share of long ones."""
    num_long = round(args.num_prompts * args.long_fraction)
    requests = random_requests(
        args.num_prompts - num_long, args.input_len, args.output_len, 0.0, seed=1
    )
    if num_long:
        requests += random_requests(
            num_long, args.long_len, args.output_len, args.long_range, seed=2
        )
        random.Random(3).shuffle(requests)
    return requests


def measure(flags: list[str], args: argparse.Namespace) -> dict[str, Any]:
    server = start_server(
        *([args.model] if args.model else []),
        "--load-format", args.load_format, "--served-model-name", "m",
        "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory-bytes", str(args.kv_cache_gib << 30),
        *flags, timeout=900,
    )  # fmt: skip
    try:
        prompts = [r.prompt for r in random_requests(3, args.input_len, 1, 0.0, seed=7)]
        tokens = greedy_tokens(server, prompts, 32)  # also warms both replicas up
        requests = workload(args)
        target = Target(
            base_url=server.url,
            endpoint=COMPLETIONS,
            model="m",
            headers=server.headers(),
            ignore_eos=True,
            extra_body={"temperature": 0.0},
        )
        run = asyncio.run(run_requests(target, requests, args.request_rate, 1.0, None, seed=0))
        summary = summarize(run.results, run.duration, [50.0, 90.0, 99.0], [])
        return {
            "flags": flags,
            "greedy": tokens,
            "serve": summary,
            "metrics": replica_metrics(server),
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="default: the embedded SmolLM2")
    parser.add_argument("--input-len", type=int, default=3000)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--baseline", choices=("one", "dp"), default="one")
    parser.add_argument("--long-fraction", type=float, default=0.0)
    parser.add_argument("--long-len", type=int, default=10000)
    parser.add_argument("--long-range", type=float, default=0.6)
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-cache-gib", type=int, default=30)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--kv-buffer-devices", nargs="+", default=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu"}
    report["args"] = vars(args)
    report["pinned_h2d_gb_per_s"] = pinned_copy_gb_per_s() if cuda else None
    report["transfer_path"] = transfer_path() if cuda else None
    print(json.dumps(report["transfer_path"]), flush=True)
    baseline = [] if args.baseline == "one" else ["--data-parallel-size", "2"]
    report["baseline"] = measure(baseline, args)
    runs = ["baseline"]
    for device in args.kv_buffer_devices:
        name = "disaggregated" + ("" if device == "cpu" else f"_{device}")
        flags = ["--data-parallel-size", "2", "--prefill-replicas", "1"]
        report[name] = measure([*flags, "--kv-buffer-device", device], args)
        report[name]["greedy_equal"] = report["baseline"]["greedy"] == report[name]["greedy"]
        metrics = report[name]["metrics"]
        seconds = sum(metrics.get("kv_transfer_import_seconds_total", {}).values())
        moved = sum(metrics.get("kv_transfer_bytes_imported_total", {}).values())
        report[name]["import_gb_per_s"] = moved / seconds / 1e9 if seconds else None
        runs.append(name)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    for name in runs:
        serve, run = report[name]["serve"], report[name]
        print(
            f"{name}: TTFT median {serve.get('median_ttft_ms')}, ITL median "
            f"{serve.get('median_itl_ms')} p99 {serve.get('p99_itl_ms')}, TPOT p99 "
            f"{serve.get('p99_tpot_ms')}, output tok/s {serve.get('output_throughput')}; "
            f"greedy equal {run.get('greedy_equal')}, import {run.get('import_gb_per_s')} GB/s"
        )
    print(f"pinned H2D {report['pinned_h2d_gb_per_s']} GB/s")


if __name__ == "__main__":
    main()
