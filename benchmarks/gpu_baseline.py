"""A first look at kvflow on a GPU with the torch reference kernels (before Triton).

Dummy bf16 weights of a real architecture; random-token prompts, greedy, ignore EOS.
Prints decode latency at batch 1 and offline throughput; writes JSON to $OUT or ./.

    python benchmarks/gpu_baseline.py --model Llama-3.1-8B
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from kvflow import LLM, SamplingParams


def prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=generator).tolist()


def timed_generate(llm: LLM, batch: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = llm.generate(batch, params)
    torch.cuda.synchronize()
    assert all(len(r.token_ids) == output_len for r in results)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Llama-3.1-8B")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--kv-gib", type=float, default=16.0)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="Also print a torch profiler table of a batch-1 decode run.",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    llm = LLM(
        args.model,
        load_format="dummy",
        device="cuda",
        max_model_len=4096,
        kv_cache_memory_bytes=int(args.kv_gib * 2**30),
        enable_prefix_caching=False,
    )
    load_s = time.perf_counter() - start
    vocab = llm.engine.model_config.vocab_size
    timed_generate(llm, prompts(2, 128, vocab, 1), 8)  # warm-up
    # Batch-1 decode latency: 256 tokens minus a 1-token run removes prefill and overhead.
    long = timed_generate(llm, prompts(1, 128, vocab, 2), 257)
    short = timed_generate(llm, prompts(1, 128, vocab, 3), 1)
    itl_ms = 1000 * (long - short) / 256
    offline_s = timed_generate(llm, prompts(args.num_prompts, 512, vocab, 4), 256)
    report = {
        "model": args.model,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "load_s": round(load_s, 1),
        "batch1_itl_ms": round(itl_ms, 2),
        "offline": {
            "num_prompts": args.num_prompts,
            "input_len": 512,
            "output_len": 256,
            "seconds": round(offline_s, 2),
            "output_tok_per_s": round(args.num_prompts * 256 / offline_s, 1),
        },
    }
    if args.profile:
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            timed_generate(llm, prompts(1, 128, vocab, 5), 16)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    out = Path(os.environ.get("OUT", ".")) / "gpu_baseline.json"
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
