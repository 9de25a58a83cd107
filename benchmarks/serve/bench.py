"""`kvflow bench serve`: datasets → runs at each request rate → table, JSON, plots."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from benchmarks.serve.checks import check_serve_args
from benchmarks.serve.datasets import (
    DEFAULT_VOCAB_BOUND,
    SampleRequest,
    Tokenizer,
    batched,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from benchmarks.serve.flags import SAMPLING
from benchmarks.serve.metrics import format_table, summarize
from benchmarks.serve.results import result_path, result_record, timestamp, write_result
from benchmarks.serve.runner import Run, Target, print_progress, run_requests

# Each rate's prompts come from their own seed, so a later rate finds nothing of an earlier
# one in the prefix cache ("fresh prompts per run").
_SEED_STRIDE = 1_000_003


def make_requests(
    args: argparse.Namespace, num: int, seed: int, tokenizer: Tokenizer | None
) -> list[SampleRequest]:
    bound = len(tokenizer) if tokenizer is not None else DEFAULT_VOCAB_BOUND
    if args.dataset_name == "random":
        requests = random_requests(
            num,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            seed,
            bound,
            prefix_len=args.random_prefix_len,
        )
        return batched(requests, args.random_batch_size) if args.random_batch_size > 1 else requests
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
    return sharegpt_requests(
        args.dataset_path,
        num,
        seed,
        tokenizer,
        args.sharegpt_output_len,
        shuffle=not args.disable_shuffle,
        oversample=not args.no_oversample,
    )


def load_tokenizer(args: argparse.Namespace) -> Tokenizer | None:
    if args.tokenizer is None:
        return None
    from transformers import AutoTokenizer  # only with --tokenizer: a heavy import

    tokenizer: Tokenizer = AutoTokenizer.from_pretrained(
        args.tokenizer, trust_remote_code=args.trust_remote_code
    )
    return tokenizer


@dataclass(frozen=True)
class Model:
    """The name the requests carry, and the id the result file is named by."""

    requested: str
    model_id: str


async def served_model(base_url: str, headers: dict[str, str]) -> Model:
    """The first model the server lists: its id, and its root (the path it was loaded from,
    as vLLM names its result files by) where the server gives one."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{base_url}/v1/models", headers=headers) as response,
    ):
        if response.status != 200:
            raise SystemExit(f"{base_url}/v1/models answered HTTP {response.status}")
        models = (await response.json())["data"]
    if not models:
        raise SystemExit(f"{base_url}/v1/models lists no model")
    first = models[0]
    return Model(str(first["id"]), str(first.get("root") or first["id"]))


async def resolve_model(args: argparse.Namespace, base_url: str, headers: dict[str, str]) -> Model:
    """vLLM's rule: --model names the model (and --served-model-name the requests' model);
    without --model, the server's first."""
    listed = None if args.model is not None else await served_model(base_url, headers)
    model_id = args.model if listed is None else listed.model_id
    requested = args.served_model_name or args.model or (listed.requested if listed else "")
    return Model(requested, model_id)


def request_headers(args: argparse.Namespace) -> dict[str, str]:
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    headers.update(dict(args.header))
    return headers


def target_of(args: argparse.Namespace, model: str, headers: dict[str, str]) -> Target:
    extra = {name: value for name in SAMPLING if (value := getattr(args, name)) is not None}
    extra.update(args.extra_body or {})
    return Target(
        base_url=args.base_url or f"http://{args.host}:{args.port}",
        endpoint=args.endpoint,
        model=model,
        headers=headers,
        ignore_eos=args.ignore_eos,
        extra_body=extra,
    )


async def measure_rate(
    args: argparse.Namespace,
    target: Target,
    tokenizer: Tokenizer | None,
    index: int,
    rate: float,
) -> tuple[Run, dict[str, Any]]:
    """One rate's run on fresh prompts: its table printed, its figures returned."""
    progress = None if args.disable_tqdm else print_progress
    requests = make_requests(args, args.num_prompts, args.seed + index * _SEED_STRIDE, tokenizer)
    if progress is not None:
        progress(f"request rate {rate:g}/s: {len(requests)} requests to {target.base_url}")
    run = await run_requests(
        target, requests, rate, args.burstiness, args.max_concurrency, args.seed, progress
    )
    summary = summarize(
        run.results, run.duration, args.metric_percentiles, args.goodput, args.percentile_metrics
    )
    title = f"Serving Benchmark Result, {rate:g} req/s"
    print(format_table(title, summary, args.metric_percentiles, args.percentile_metrics))
    return run, summary


def save_result(args: argparse.Namespace, model_id: str, run: Run, summary: dict[str, Any]) -> str:
    """vLLM's result file for this run (--save-result, --append-result); its path."""
    stamp = timestamp()
    path = result_path(args, model_id, run.request_rate, stamp)
    results = run.results if args.save_detailed else None
    record = result_record(args, stamp, model_id, run.request_rate, summary, results)
    write_result(path, record, args.append_result)
    print(f"result: {path}")
    return str(path)


def rate_report(
    args: argparse.Namespace, run: Run, summary: dict[str, Any], result_file: str | None
) -> dict[str, Any]:
    """One rate's entry of kvflow's own report (--output-json)."""
    rate = run.request_rate
    report: dict[str, Any] = {
        "request_rate": "inf" if math.isinf(rate) else rate,
        **summary,
        "server_samples": run.server_samples,
        "server_monitor_problem": run.monitor_problem,
        "result_file": result_file,
    }
    if args.save_detailed:
        report["requests"] = [{**asdict(r), "send_time": r.start - run.origin} for r in run.results]
    return report


async def run_all(args: argparse.Namespace) -> tuple[dict[str, Any], list[Run]]:
    headers = request_headers(args)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    model = await resolve_model(args, base_url, headers)
    target = target_of(args, model.requested, headers)
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args)
    if args.num_warmups:
        warmups = make_requests(args, args.num_warmups, args.seed - 1, tokenizer)
        await run_requests(target, warmups, math.inf, 1.0, 1, args.seed)
    runs, reports = [], []
    for index, rate in enumerate(args.request_rate):
        run, summary = await measure_rate(args, target, tokenizer, index, rate)
        saved = args.save_result or args.append_result
        result_file = save_result(args, model.model_id, run, summary) if saved else None
        runs.append(run)
        reports.append(rate_report(args, run, summary, result_file))
    header = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "base_url": target.base_url,
        "endpoint": target.endpoint,
        "backend": args.backend,
        "model": model.requested,
        "model_id": model.model_id,
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
    check_serve_args(args)
    report, runs = asyncio.run(run_all(args))
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot is not None:
        from benchmarks.serve.plots import draw_all  # matplotlib only when plotting

        for path in draw_all(runs, args.plot):
            print(f"plot: {path}")
    return 1 if any(r["failed"] for r in report["runs"]) else 0
