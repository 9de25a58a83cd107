"""`kvflow bench multi-turn`: conversations that each grow by a turn, every turn resending the
whole history, so that once the histories outgrow the GPU's KV pool each turn finds its prefix
evicted: recomputed, or restored from the prefix cache's host tier (`--kv-offloading-size`).

Each turn of each conversation runs alone (batch 1) and is timed to its first token (the
prefill of what the caches miss, and the copies back); its reply is that token and
--output-len - 1 random ones, which the next turn resends with its own --turn-len new tokens,
as a chat client resends the assistant's message. The shape follows vLLM's multi-turn
benchmark; prompts are random token ids, so any model runs without a tokenizer.

    kvflow bench multi-turn Qwen3-8B --load-format dummy --num-gpu-blocks-override 2000 \
        --kv-offloading-size 24
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from benchmarks.engine_bench import _device_name, _engine_summary, _llm
from kvflow import LLM, SamplingParams
from shared.config import Config
from shared.protocol import HostTierStats

FIRST = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def multi_turn(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    llm = _llm(config)
    vocab = llm.runner.model_config.vocab_size
    rng = random.Random(args.seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    llm.generate([draw(args.first_len)], FIRST)  # compiles and warms up, then is forgotten
    histories = [draw(args.first_len) for _ in range(args.conversations)]
    turns = []
    for turn in range(args.turns):
        new = [[] if turn == 0 else draw(args.turn_len) for _ in histories]
        turns.append(_turn(llm, histories, new, args.output_len, draw))
        print(f"turn {turn}: median TTFT {turns[-1]['ttft_ms_median']:.1f} ms", flush=True)
    later = [t for turn in turns[1:] for t in turn.pop("ttfts_ms")]
    turns[0].pop("ttfts_ms")
    return {
        "benchmark": "multi-turn",
        "model": config.model,
        "device": _device_name(llm),
        "conversations": args.conversations,
        "first_len": args.first_len,
        "turn_len": args.turn_len,
        "output_len": args.output_len,
        "later_turns_ttft_ms_median": statistics.median(later) if later else None,
        "turns": turns,
        "config": _engine_summary(config),
    }


def _turn(
    llm: LLM, histories: list[list[int]], new: list[list[int]], output_len: int, draw: Any
) -> dict[str, Any]:
    """One turn of every conversation, one at a time; `histories` grow by it."""
    before = llm.stats()
    ttfts = []
    for history, added in zip(histories, new, strict=True):
        history += added
        start = time.perf_counter()
        first = llm.generate([history], FIRST)[0].token_ids
        ttfts.append((time.perf_counter() - start) * 1e3)
        history += first + draw(output_len - 1)
    after = llm.stats()
    return {
        "ttft_ms_median": statistics.median(ttfts),
        "ttft_ms_mean": statistics.fmean(ttfts),
        "prompt_tokens": after.prefix_cache_queries - before.prefix_cache_queries,
        "gpu_prefix_hit_tokens": after.prefix_cache_hits - before.prefix_cache_hits,
        **_tier_counts(before.host_tier, after.host_tier),
        "ttfts_ms": ttfts,
    }


def _tier_counts(before: HostTierStats | None, after: HostTierStats | None) -> dict[str, Any]:
    """What the host tier (and the disk behind it) did in a turn: tokens restored, blocks
    read back from disk and the executor's seconds reading them."""
    if after is None or before is None:
        return {"host_tier_hit_tokens": 0}
    counts: dict[str, Any] = {"host_tier_hit_tokens": after.hits - before.hits}
    if after.num_disk_blocks:
        counts["blocks_from_disk"] = after.blocks_from_disk - before.blocks_from_disk
        counts["blocks_to_disk"] = after.blocks_to_disk - before.blocks_to_disk
        counts["disk_read_s"] = round(after.disk_read_seconds - before.disk_read_seconds, 3)
    return counts
