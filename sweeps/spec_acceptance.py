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
import time
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
    start = time.perf_counter()
    results = []
    for first in range(0, len(conversations), batch):
        results += llm.chat(conversations[first : first + batch], params)
    seconds = time.perf_counter() - start
    tokens = [r.outputs[0].token_ids for r in results]
    stats = llm.stats()
    drafts = stats.spec_num_drafts
    return {
        "seconds": seconds,
        "output_tokens": sum(map(len, tokens)),
        "output_tok_per_s": sum(map(len, tokens)) / seconds,
        "tokens": tokens,
        "num_drafts": drafts,
        "num_draft_tokens": stats.spec_num_draft_tokens,
        "num_accepted_tokens": stats.spec_num_accepted_tokens,
        "mean_acceptance_length": 1 + stats.spec_num_accepted_tokens / drafts if drafts else None,
        "accepted_per_position": stats.spec_accepted_per_position,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model folder (sweeps/smollm2_folder.py writes one)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=8, help="of each kind")
    parser.add_argument("--batch", type=int, default=0, help="prompts a call (0: all)")
    parser.add_argument("--config", action="append", help="a --speculative-config (repeatable)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    prompts = code_prompts(args.num_prompts) + doc_prompts(args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    batch = args.batch or len(prompts)
    configs = [json.loads(c) for c in args.config] if args.config else CONFIGS
    engine = dict(device=args.device, dtype=args.dtype, max_model_len=2048)
    runs = {"none": run(LLM(args.model, **engine), prompts, params, batch)}
    for config in configs:
        llm = LLM(args.model, speculative_config=config, **engine)
        runs[json.dumps(config)] = run(llm, prompts, params, batch)
    plain = runs["none"]
    print(f"{len(prompts)} prompts, batch {batch}, up to {args.max_tokens} tokens each")
    for name, result in runs.items():
        result["same_output"] = result["tokens"] == plain["tokens"]
        result["speedup"] = result["output_tok_per_s"] / plain["output_tok_per_s"]
        print(
            f"{name}: {result['output_tok_per_s']:.1f} tok/s ({result['speedup']:.2f}x), "
            f"mean acceptance length {result['mean_acceptance_length']}, "
            f"same output: {result['same_output']}"
        )
    if args.out:
        for result in runs.values():
            del result["tokens"]
        args.out.write_text(json.dumps({"batch": batch, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
