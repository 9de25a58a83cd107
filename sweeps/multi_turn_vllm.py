"""`kvflow bench multi-turn`'s workload on vLLM (benchmarks/multi_turn.py): the same
conversations of random token ids, drawn from the same seed in the same order, each turn of
each conversation alone and timed to its first token; with vLLM's native KV offloading
(`--kv-offloading-size`) or without. For the side-by-side in docs/benchmarks.md ("multi-turn").

    python sweeps/multi_turn_vllm.py /tmp/qwen3-8b --num-gpu-blocks-override 2000 \\
        --kv-offloading-size 16 --out $OUT/vllm_mt.json

It imports vLLM and nothing of kvflow: run it with vLLM's environment, from a directory
outside the checkout.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=2000)
    parser.add_argument("--kv-offloading-size", type=float, default=None)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--first-len", type=int, default=2000)
    parser.add_argument("--turn-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    engine: dict[str, Any] = dict(
        model=args.model,
        load_format="dummy",
        max_model_len=args.max_model_len,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=True,
    )
    if args.kv_offloading_size is not None:
        engine.update(kv_offloading_size=args.kv_offloading_size, kv_offloading_backend="native")
    llm = LLM(**engine)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(args.seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def ttft(history: list[int]) -> tuple[float, list[int]]:
        start = time.perf_counter()
        output = llm.generate([{"prompt_token_ids": history}], first, use_tqdm=False)[0]
        return (time.perf_counter() - start) * 1e3, list(output.outputs[0].token_ids)

    ttft(draw(args.first_len))  # compiles and warms up, then is forgotten
    histories = [draw(args.first_len) for _ in range(args.conversations)]
    turns = []
    for turn in range(args.turns):
        times = []
        new = [[] if turn == 0 else draw(args.turn_len) for _ in histories]
        for history, added in zip(histories, new, strict=True):
            history += added
            ms, token = ttft(history)
            times.append(ms)
            history += token + draw(args.output_len - 1)
        turns.append({"ttft_ms_median": statistics.median(times), "ttfts_ms": times})
        print(f"turn {turn}: median TTFT {turns[-1]['ttft_ms_median']:.1f} ms", flush=True)
    later = [t for turn in turns[1:] for t in turn["ttfts_ms"]]
    report = {
        "engine": "vllm",
        "kv_offloading_size": args.kv_offloading_size,
        "later_turns_ttft_ms_median": statistics.median(later),
        "turns": [{"ttft_ms_median": t["ttft_ms_median"]} for t in turns],
    }
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
