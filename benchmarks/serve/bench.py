"""`kvflow bench serve`: datasets → runs at each request rate → table, JSON, plots."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
from dataclasses import asdict
from typing import Any

import aiohttp

from benchmarks.serve.client import CHAT
from benchmarks.serve.datasets import (
    DEFAULT_VOCAB_BOUND,
    SampleRequest,
    Tokenizer,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from benchmarks.serve.metrics import format_table, summarize
from benchmarks.serve.runner import Run, Target, print_progress, run_requests

# Each rate's prompts come from their own seed, so a later rate finds nothing of an earlier
# one in the prefix cache ("fresh prompts per run").
_SEED_STRIDE = 1_000_003


def make_requests(
    args: argparse.Namespace, num: int, seed: int, tokenizer: Tokenizer | None
) -> list[SampleRequest]:
    bound = len(tokenizer) if tokenizer is not None else DEFAULT_VOCAB_BOUND
    if args.dataset_name == "random":
        return random_requests(
            num,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            seed,
            bound,
        )
    if args.dataset_name == "prefix-repetition":
        return prefix_repetition_requests(
            num,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            seed,
            bound,
        )
    if args.dataset_path is None:
        raise SystemExit("--dataset-name sharegpt needs --dataset-path FILE.json")
    return sharegpt_requests(args.dataset_path, num, seed, tokenizer, args.sharegpt_output_len)


def load_tokenizer(name: str | None) -> Tokenizer | None:
    if name is None:
        return None
    from transformers import AutoTokenizer  # only with --tokenizer: a heavy import

    tokenizer: Tokenizer = AutoTokenizer.from_pretrained(name)
    return tokenizer


async def served_model(base_url: str, headers: dict[str, str]) -> str:
    """The first model id the server lists."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{base_url}/v1/models", headers=headers) as response,
    ):
        if response.status != 200:
            raise SystemExit(f"{base_url}/v1/models answered HTTP {response.status}")
        models = (await response.json())["data"]
    if not models:
        raise SystemExit(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


def target_of(args: argparse.Namespace, model: str, headers: dict[str, str]) -> Target:
    extra = {
        name: value
        for name in ("temperature", "top_p", "top_k")
        if (value := getattr(args, name)) is not None
    }
    extra.update(args.extra_body or {})
    return Target(
        base_url=args.base_url or f"http://{args.host}:{args.port}",
        endpoint=args.endpoint,
        model=model,
        headers=headers,
        ignore_eos=args.ignore_eos,
        extra_body=extra,
    )


async def run_all(args: argparse.Namespace) -> tuple[dict[str, Any], list[Run]]:
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    model = args.model or await served_model(base_url, headers)
    if args.endpoint == CHAT and args.dataset_name != "sharegpt":
        raise SystemExit(f"{CHAT} needs text prompts: --dataset-name sharegpt")
    target = target_of(args, model, headers)
    tokenizer = load_tokenizer(args.tokenizer)
    progress = None if args.disable_tqdm else print_progress
    if args.num_warmups:
        warmups = make_requests(args, args.num_warmups, args.seed - 1, tokenizer)
        await run_requests(target, warmups, math.inf, 1.0, 1, args.seed)
    runs, reports = [], []
    for index, rate in enumerate(args.request_rate):
        requests = make_requests(
            args, args.num_prompts, args.seed + index * _SEED_STRIDE, tokenizer
        )
        if progress is not None:
            progress(f"request rate {rate:g}/s: {len(requests)} requests to {target.base_url}")
        run = await run_requests(
            target, requests, rate, args.burstiness, args.max_concurrency, args.seed, progress
        )
        summary = summarize(run.results, run.duration, args.metric_percentiles, args.goodput)
        print(
            format_table(
                f"Serving Benchmark Result, {rate:g} req/s", summary, args.metric_percentiles
            )
        )
        report: dict[str, Any] = {
            "request_rate": "inf" if math.isinf(rate) else rate,
            **summary,
            "server_samples": run.server_samples,
            "server_monitor_problem": run.monitor_problem,
        }
        if args.save_detailed:
            report["requests"] = [
                {**asdict(r), "send_time": r.start - run.origin} for r in run.results
            ]
        runs.append(run)
        reports.append(report)
    header = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "base_url": target.base_url,
        "endpoint": target.endpoint,
        "model": model,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "max_concurrency": args.max_concurrency,
        "burstiness": args.burstiness,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "sampling": target.extra_body,
        "runs": reports,
    }
    return header, runs


def main(args: argparse.Namespace) -> int:
    report, runs = asyncio.run(run_all(args))
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot is not None:
        from benchmarks.serve.plots import draw_all  # matplotlib only when plotting

        for path in draw_all(runs, args.plot):
            print(f"plot: {path}")
    return 1 if any(r["failed"] for r in report["runs"]) else 0
