"""Where an embedding step's time goes, in-process (no HTTP): `LLM.embed` over random prompts
of a Qwen3-Embedding-0.6B-shaped model with dummy weights, timed at two token budgets, then
one call under the torch profiler (the top CUDA kernels and CPU ops). One token budget a
process: an `LLM` holds its GPU memory until its process ends.

    python -m sweeps.embedding_model QWEN3_FOLDER /tmp/emb
    python -m sweeps.embed_profile /tmp/emb --budget 4096 --profile --out embed_4096.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from kvflow import LLM


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--budget", type=int, default=4096, help="--max-num-batched-tokens")
    parser.add_argument("--profile", action="store_true", help="Also one call profiled.")
    parser.add_argument("--count", type=int, default=2048)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    llm = LLM(
        str(args.model),
        load_format="dummy",
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.budget,
    )
    llm.embed(prompts(64, args.length, vocab, 0))  # first-use compiles
    batch = prompts(args.count, args.length, vocab, 1)
    start = time.perf_counter()
    llm.embed(batch)
    seconds = time.perf_counter() - start
    figures: dict[str, object] = {
        "budget": args.budget,
        "prompts": args.count,
        "prompt_len": args.length,
        "seconds": seconds,
        "tok_per_s": args.count * args.length / seconds,
    }
    print(json.dumps(figures), flush=True)
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            llm.embed(prompts(256, args.length, vocab, 2))
        for sort in ("cuda_time_total", "cpu_time_total"):
            table = prof.key_averages().table(sort_by=sort, row_limit=25)
            print(table)
            figures[f"profile_by_{sort}"] = table
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
