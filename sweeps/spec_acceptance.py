"""Speculative decoding on text where it pays: how many tokens a verifying row moves (the mean
acceptance length), output tokens per second against the same engine without speculation, and
a check that every output is the one greedy decoding gives without it.

    python -m sweeps.smollm2_folder /tmp/smollm2-bf16
    python -m sweeps.spec_acceptance /tmp/smollm2-bf16 --out /tmp/spec_acceptance.json

The prompts quote their input, as code editing and summaries do: functions of this repository
to rewrite with type hints and a docstring, and paragraphs of its docs to summarize in their
own words. Nothing is downloaded. `--batch 1` runs the prompts one at a time (latency); the
default runs them all at once (throughput).
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import subprocess
import sys
import tempfile
import time
from itertools import zip_longest
from pathlib import Path
from typing import Any

from kvflow import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
NGRAM = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
CONFIGS = [
    {**NGRAM, "num_speculative_tokens": 4},
    {**NGRAM, "num_speculative_tokens": 8},
    {"method": "suffix", "num_speculative_tokens": 8},
]
CODE_FILES = (
    "services/scheduler/admission.py",
    "services/scheduler/kv_cache_manager.py",
    "services/tokenizer/stop_strings.py",
    "shared/speculative.py",
    "services/scheduler/block_pool.py",
    "services/executor/speculative/suffix.py",
    "services/tokenizer/detokenizer.py",
    "services/executor/runner/sampler.py",
)
DOC_FILES = ("docs/reliability.md", "docs/serving.md")


def code_prompts(limit: int) -> list[str]:
    """Functions of 8-30 lines, to be rewritten whole."""
    prompts = []
    for name in CODE_FILES:
        source = (ROOT / name).read_text()
        for node in ast.walk(ast.parse(source)):
            length = (node.end_lineno or 0) - node.lineno if isinstance(node, ast.stmt) else 0
            if isinstance(node, ast.FunctionDef) and 8 <= length <= 30:
                code = ast.get_source_segment(source, node)
                prompts.append(
                    "Rewrite this Python function with full type hints and a one-line docstring."
                    f" Keep everything else exactly as it is. Reply with the code only.\n\n{code}"
                )
    return prompts[:limit]


def doc_prompts(limit: int) -> list[str]:
    """Paragraphs of 400-1200 characters, to be summarized."""
    prompts = []
    for name in DOC_FILES:
        for paragraph in (ROOT / name).read_text().split("\n\n"):
            if 400 <= len(paragraph) <= 1200 and not paragraph.startswith(("#", "|", "```")):
                prompts.append(f"Summarize this text, quoting its key sentences:\n\n{paragraph}")
    return prompts[:limit]


def run(llm: LLM, prompts: list[str], params: SamplingParams, batch: int) -> dict[str, Any]:
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    before = llm.stats()
    start = time.perf_counter()
    results = []
    for first in range(0, len(conversations), batch):
        results += llm.chat(conversations[first : first + batch], params)
    seconds = time.perf_counter() - start
    after = llm.stats()
    tokens = [r.outputs[0].token_ids for r in results]
    drafts = after.spec_num_drafts - before.spec_num_drafts
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    per_position = [
        a - b
        for a, b in zip_longest(
            after.spec_accepted_per_position, before.spec_accepted_per_position, fillvalue=0
        )
    ]
    return {
        "seconds": seconds,
        "output_tokens": sum(map(len, tokens)),
        "output_tok_per_s": sum(map(len, tokens)) / seconds,
        "tokens": tokens,
        "num_drafts": drafts,
        "num_draft_tokens": after.spec_num_draft_tokens - before.spec_num_draft_tokens,
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "accepted_per_position": per_position,
    }


def prompts_of(args: argparse.Namespace) -> list[str]:
    """The prompts of --prompts (another tree's, for an A/B), or this repository's own."""
    if args.prompts:
        return list(json.loads(args.prompts.read_text()))
    return code_prompts(args.num_prompts) + doc_prompts(args.num_prompts)


# First-use compiles and graphs at the widest batch, verifying steps included: text that
# repeats itself, so that n-gram drafts are taken, and none of the timed prompts (no prefix hit).
WARM_UP = [[{"role": "user", "content": "Say this three times: the quick brown fox jumps over "
             "the lazy dog."}]]  # fmt: skip


def measure(args: argparse.Namespace, config: dict | None) -> dict[int, dict[str, Any]]:
    """One engine (speculating by `config`, or not) over the prompts at every batch size."""
    prompts = prompts_of(args)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm = LLM(
        args.model,
        speculative_config=config,
        device=args.device,
        dtype=args.dtype,
        max_model_len=2048,
        gpu_memory_utilization=args.gpu_memory_utilization,
        batch_invariant=args.batch_invariant,
    )
    widest = max(b or len(prompts) for b in args.batch)
    llm.chat(WARM_UP * widest, SamplingParams(temperature=0.0, max_tokens=32))
    return {b or len(prompts): run(llm, prompts, params, b or len(prompts)) for b in args.batch}


def measure_apart(args: argparse.Namespace, config: dict | None) -> dict[int, dict[str, Any]]:
    """measure() in a process of its own, so that each engine has the device to itself; a
    config whose engine fails gives no runs (the others' are still reported)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "runs.json"
        command = [sys.executable, "-m", "sweeps.spec_acceptance", args.model, "--one"]
        command += [json.dumps(config), "--out", str(out), *forwarded(args)]
        if subprocess.run(command, cwd=ROOT).returncode != 0:
            print(f"{json.dumps(config)}: the engine failed, left out", file=sys.stderr)
            return {}
        return {int(b): r for b, r in json.loads(out.read_text()).items()}


def forwarded(args: argparse.Namespace) -> list[str]:
    flags = ["--device", args.device, "--dtype", args.dtype, "--max-tokens", str(args.max_tokens)]
    flags += ["--num-prompts", str(args.num_prompts)]
    flags += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    flags += ["--prompts", str(args.prompts.resolve())] if args.prompts else []
    flags += ["--batch-invariant"] if args.batch_invariant else []
    return flags + [f"--batch={b}" for b in args.batch]


def report(runs: dict[str, dict[int, dict[str, Any]]], num_prompts: int, max_tokens: int) -> None:
    print(f"{num_prompts} prompts, up to {max_tokens} tokens each")
    for batch in runs["null"]:
        plain = runs["null"][batch]
        for name, by_batch in runs.items():
            if batch not in by_batch:
                continue
            result = by_batch[batch]
            result["same_output"] = result["tokens"] == plain["tokens"]
            result["same_outputs"] = sum(map(operator.eq, result["tokens"], plain["tokens"]))
            result["first_differences"] = [
                next(i for i, (a, b) in enumerate(zip_longest(got, want)) if a != b)
                for got, want in zip(result["tokens"], plain["tokens"], strict=True)
                if got != want
            ]
            result["speedup"] = result["output_tok_per_s"] / plain["output_tok_per_s"]
            print(
                f"batch {batch} {name}: {result['output_tok_per_s']:.1f} tok/s "
                f"({result['speedup']:.2f}x), mean acceptance length "
                f"{result['mean_acceptance_length']}, the same output as without for "
                f"{result['same_outputs']} of {len(plain['tokens'])} prompts (the others from"
                f" token {result['first_differences']} on)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model folder (sweeps/smollm2_folder.py writes one)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=8, help="of each kind")
    parser.add_argument("--batch", type=int, action="append", help="prompts a call (0: all)")
    parser.add_argument("--config", action="append", help="a --speculative-config (repeatable)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # measure_apart's child: this config
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep-tokens", action="store_true", help="the outputs' ids in --out")
    parser.add_argument(
        "--batch-invariant", action="store_true", help="both engines with --batch-invariant"
    )
    parser.add_argument("--prompts-out", type=Path, help="the prompts as JSON, for another engine")
    parser.add_argument("--prompts", type=Path, help="read the prompts from a --prompts-out file")
    args = parser.parse_args()
    args.batch = args.batch or [0]
    if args.one is not None:
        args.out.write_text(json.dumps(measure(args, json.loads(args.one))))
        return
    if args.prompts_out:
        args.prompts_out.write_text(json.dumps(prompts_of(args)))
    configs = [json.loads(c) for c in args.config] if args.config else CONFIGS
    runs = {json.dumps(c): measure_apart(args, c) for c in [None, *configs]}
    report(runs, len(prompts_of(args)), args.max_tokens)
    if args.out:
        for by_batch in runs.values():
            for result in by_batch.values():
                if not args.keep_tokens:
                    del result["tokens"]
        args.out.write_text(json.dumps({"max_tokens": args.max_tokens, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
