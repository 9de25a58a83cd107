"""`kvflow bench`: the command line of kvflow's engine and kernel benchmarks.

Every benchmark prints its figures and, with --output-json, writes them as JSON. Prompts are
random token ids, so any model shape runs without a tokenizer:

    kvflow bench throughput Llama-3.1-8B --load-format dummy --num-prompts 256

This module only builds the parser (the `kvflow` command imports it); the benchmarks
themselves import torch when they run.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.serve.flags import add_serve_flags
from shared.config import OFFLINE_DEFAULTS, config_from_args


def parse_length(text: str) -> tuple[int, int]:
    """`512` or a uniform range `100:1024`."""
    low, _, high = text.partition(":")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"bad length {text!r}: want N or LOW:HIGH, 1 <= LOW")
    return bounds


def add_bench_parser(
    commands: Any, engine_flags: Callable[[argparse.ArgumentParser], None]
) -> None:
    bench = commands.add_parser(
        "bench",
        help="Benchmarks: serve, throughput, latency, multi-turn, attention, floors, moe.",
        description="Measure kvflow with random-token prompts; figures to stdout and JSON.",
    )
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    serve = kinds.add_parser(
        "serve",
        help="Load a running OpenAI-compatible server over HTTP/SSE: TTFT, TPOT, ITL, goodput.",
        description="Send a dataset's requests to any OpenAI-compatible server at a request "
        "rate and measure it at the client. Takes `vllm bench serve`'s command lines and "
        "writes its result file (--save-result); refuses what it cannot do.",
        usage="%(prog)s [OPTIONS] (--help lists them)",
    )
    add_serve_flags(serve)
    throughput = kinds.add_parser("throughput", help="Offline engine throughput (tok/s).")
    latency = kinds.add_parser("latency", help="Decode inter-token latency at batch 1, 8, 32.")
    _engine_flags(throughput, latency, engine_flags)
    multi_turn = kinds.add_parser(
        "multi-turn",
        help="Conversations that outgrow the GPU's KV pool: time to first token by turn.",
    )
    _multi_turn_flags(multi_turn, engine_flags)
    attention = kinds.add_parser("attention", help="Decode attention kernel GB/s vs copy.")
    _attention_flags(attention)
    floors = kinds.add_parser("floors", help="Measured copy bandwidth and bf16 matmul rate.")
    moe = kinds.add_parser("moe", help="A mixture-of-experts layer's time vs its bytes, vLLM's.")
    _moe_flags(moe)
    for parser in (throughput, latency, multi_turn, attention, floors, moe):
        parser.add_argument("--output-json", type=Path, help="Write the figures here.")


def _engine_flags(
    throughput: argparse.ArgumentParser,
    latency: argparse.ArgumentParser,
    engine_flags: Callable[[argparse.ArgumentParser], None],
) -> None:
    """What `bench throughput` and `bench latency` share (the engine's own flags among them),
    then each one's own."""
    for parser in (throughput, latency):
        parser.add_argument("model", nargs="?", help="Model or preset (see kvflow generate).")
        parser.add_argument("--input-len", type=parse_length, default=(512, 512))
        parser.add_argument("--output-len", type=parse_length, default=(256, 256))
        engine_flags(parser)
        parser.add_argument(
            "--lora-paths",
            nargs="+",
            default=[],
            help="PEFT adapter folders (with --enable-lora): throughput spreads the requests"
            " evenly over them, latency runs every request under the first"
            " (`python -m sweeps.lora_adapters` makes random ones).",
        )
        parser.add_argument(
            "--profile-steps",
            type=int,
            default=0,
            help="Also profile this many decode steps (CUDA): GPU busy and top kernels"
            " (throughput: and the first 3 steps of fresh prompts).",
        )
    throughput.add_argument("--num-prompts", type=int, default=256)
    throughput.add_argument(
        "--profile-run",
        action="store_true",
        help="Also run the workload once more, on prompts the prefix cache has not seen, under"
        " the profiler (CUDA): where the GPU waits over a whole run, and the kernels' totals.",
    )
    throughput.add_argument(
        "--ignore-eos", action="store_true", help="Always generate --output-len tokens."
    )
    latency.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])


def _multi_turn_flags(
    parser: argparse.ArgumentParser, engine_flags: Callable[[argparse.ArgumentParser], None]
) -> None:
    parser.add_argument("model", nargs="?", help="Model or preset (see kvflow generate).")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first-len", type=int, default=2000, help="the first turn's tokens")
    parser.add_argument("--turn-len", type=int, default=200, help="each later turn's new tokens")
    parser.add_argument("--output-len", type=int, default=64, help="each reply's tokens")
    engine_flags(parser)  # its --seed also draws the prompts


def _attention_flags(attention: argparse.ArgumentParser) -> None:
    attention.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    attention.add_argument("--context-lens", type=int, nargs="+", default=[1024, 4096, 32768])
    attention.add_argument("--num-heads", type=int, default=32)
    attention.add_argument("--num-kv-heads", type=int, default=8)
    attention.add_argument("--head-dim", type=int, default=128)
    attention.add_argument(
        "--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="auto: bf16"
    )


def _moe_flags(moe: argparse.ArgumentParser) -> None:
    """The layer's shape (Qwen3-30B-A3B's by default) and the peer."""
    moe.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 16, 64, 256])
    moe.add_argument("--num-experts", type=int, default=128)
    moe.add_argument("--top-k", type=int, default=8)
    moe.add_argument("--hidden-size", type=int, default=2048)
    moe.add_argument("--intermediate-size", type=int, default=768, help="an expert's width")
    moe.add_argument("--layers", type=int, default=4, help="weight sets a timed call walks")
    moe.add_argument(
        "--peer", choices=["none", "vllm"], default="none", help="also time vLLM's fused MoE"
    )
    moe.add_argument(
        "--int4", action="store_true", help="also time int4 experts (groups of 128, zero points)"
    )
    moe.add_argument(
        "--fp8",
        action="store_true",
        help="also time FP8 experts (W8A8: kvflow's a scale a row, vLLM's a scale an expert)",
    )


def run_bench(args: argparse.Namespace) -> int:
    if args.bench == "serve":
        try:
            from benchmarks.serve.bench import main
        except ImportError as exc:
            raise SystemExit(
                f"kvflow bench serve needs {exc.name}: pip install 'kvflow[bench]'"
            ) from exc
        return main(args)
    # Imported here: building the `kvflow` parser must not import torch.
    if args.bench in ("throughput", "latency"):
        from benchmarks import engine_bench

        bench = engine_bench.throughput if args.bench == "throughput" else engine_bench.latency
        report = bench(config_from_args(args, defaults=OFFLINE_DEFAULTS), args)
    elif args.bench == "multi-turn":
        from benchmarks.multi_turn import multi_turn

        report = multi_turn(config_from_args(args, defaults=OFFLINE_DEFAULTS), args)
    else:
        from benchmarks import kernel_bench

        if args.bench == "attention":
            report = kernel_bench.attention_bench(args)
        elif args.bench == "moe":
            from benchmarks.moe_bench import moe_bench

            report = moe_bench(args)
        else:
            report = kernel_bench.floors_bench()
    print(json.dumps(report, indent=2))
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
