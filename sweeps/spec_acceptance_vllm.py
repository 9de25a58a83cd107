"""sweeps/spec_acceptance.py's measurement on vLLM: the same prompts (its --prompts-out file),
the same greedy sampling and speculative configs, the same figures, for a side-by-side in one
run on one machine (docs/benchmarks.md, "speculative decoding").

    python -m sweeps.spec_acceptance MODEL --batch 1 --batch 0 --prompts-out /tmp/prompts.json
    python sweeps/spec_acceptance_vllm.py MODEL /tmp/prompts.json --batch 1 --batch 0 --out X

It imports vLLM and nothing of kvflow: run it with vLLM's environment, from a directory
outside the checkout. Each config runs in a process of its own (the engine has the device to
itself). A config vLLM cannot run is reported with its error rather than ending the run.
"""

from __future__ import annotations

import argparse
import json
import operator
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NGRAM = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
CONFIGS = [  # as sweeps/spec_acceptance.py's
    {**NGRAM, "num_speculative_tokens": 4},
    {**NGRAM, "num_speculative_tokens": 8},
    {"method": "suffix", "num_speculative_tokens": 8},
]
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def counters(llm: Any) -> dict[str, Any]:
    """vLLM's speculative-decoding counters so far (zero without speculation)."""
    found: dict[str, Any] = dict.fromkeys(SPEC_COUNTERS.values(), 0)
    found["accepted_per_position"] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            found[SPEC_COUNTERS[metric.name]] += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            found["accepted_per_position"] = list(metric.values)
    return found


def run(llm: Any, prompts: list[str], params: Any, batch: int) -> dict[str, Any]:
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    before = counters(llm)
    start = time.perf_counter()
    results = []
    for first in range(0, len(conversations), batch):
        results += llm.chat(conversations[first : first + batch], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = counters(llm)
    tokens = [list(r.outputs[0].token_ids) for r in results]
    delta = {key: after[key] - before[key] for key in SPEC_COUNTERS.values()}
    drafts = delta["num_drafts"]
    return {
        "seconds": seconds,
        "output_tokens": sum(map(len, tokens)),
        "output_tok_per_s": sum(map(len, tokens)) / seconds,
        "tokens": tokens,
        **delta,
        "mean_acceptance_length": 1 + delta["num_accepted_tokens"] / drafts if drafts else None,
        "accepted_per_position": after["accepted_per_position"],
    }


# First-use compiles and graphs at the widest batch, verifying steps included: text that
# repeats itself, so that n-gram drafts are taken, and none of the timed prompts (no prefix hit).
WARM_UP = [[{"role": "user", "content": "Say this three times: the quick brown fox jumps over "
             "the lazy dog."}]]  # fmt: skip


def measure(args: argparse.Namespace, config: dict | None) -> dict[int, dict[str, Any]]:
    from vllm import LLM, SamplingParams

    prompts = json.loads(args.prompts.read_text())
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm = LLM(
        args.model,
        speculative_config=config,
        max_model_len=2048,
        gpu_memory_utilization=args.gpu_memory_utilization,
        disable_log_stats=False,
    )
    widest = max(b or len(prompts) for b in args.batch)
    llm.chat(WARM_UP * widest, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    return {b or len(prompts): run(llm, prompts, params, b or len(prompts)) for b in args.batch}


def measure_apart(args: argparse.Namespace, config: dict | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "runs.json"
        command = [sys.executable, __file__, args.model, str(args.prompts), "--one"]
        command += [json.dumps(config), "--out", str(out), "--max-tokens", str(args.max_tokens)]
        command += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        command += [f"--batch={b}" for b in args.batch]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return {"error": done.stderr.strip().splitlines()[-1:]}
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("prompts", type=Path, help="sweeps/spec_acceptance.py --prompts-out")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, action="append", help="prompts a call (0: all)")
    parser.add_argument("--config", action="append", help="a --speculative-config (repeatable)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.batch = args.batch or [0]
    if args.one is not None:
        args.out.write_text(json.dumps(measure(args, json.loads(args.one))))
        return
    configs = [json.loads(c) for c in args.config] if args.config else CONFIGS
    runs = {json.dumps(c): measure_apart(args, c) for c in [None, *configs]}
    plain = runs["null"]
    for name, by_batch in runs.items():
        for batch, result in by_batch.items():
            if batch == "error" or "error" in plain:
                print(f"{name}: {result}")
                continue
            result["same_output"] = result["tokens"] == plain[batch]["tokens"]
            same = map(operator.eq, result["tokens"], plain[batch]["tokens"])
            result["same_outputs"] = sum(same)
            result["speedup"] = result["output_tok_per_s"] / plain[batch]["output_tok_per_s"]
            print(
                f"batch {batch} {name}: {result['output_tok_per_s']:.1f} tok/s "
                f"({result['speedup']:.2f}x), mean acceptance length "
                f"{result['mean_acceptance_length']}, the same output as without for "
                f"{result['same_outputs']} of {len(result['tokens'])} prompts"
            )
    for by_batch in runs.values():
        for result in by_batch.values():
            if isinstance(result, dict):
                result.pop("tokens", None)
    if args.out:
        args.out.write_text(json.dumps({"max_tokens": args.max_tokens, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
