"""The int4 experts' tiles at Qwen3-30B-A3B's layer shape (GPU), groups of 128 with zero points:

    python3 -m sweeps.moe_int4_sweep --out moe_int4_sweep.json

At a decode's token counts, the GEMVs' tiles (kernels/triton_moe_int4_gemv.py, coordinate
descent: gate/up, then down) against the grouped GEMMs; past them, the grouped GEMMs' tiles
(kernels/triton_moe_int4.py `INT4_TILES`, both GEMMs alike) at the engine's block_m. Each
figure is a layer's routing and experts, microseconds, from one CUDA graph over 4 layers of
weights, as `kvflow bench moe --int4` times them. A time budget stops the sweep early; what
was measured is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.moe_bench import int4_stack
from kernels import ops
from kernels.triton_moe_int4 import int4_grouped_tiles, moe_experts_int4_grouped
from kernels.triton_moe_int4_gemv import Int4GemvTiles, moe_experts_int4_gemv
from kernels.triton_moe_tiles import GemmTiles, GroupedTiles
from sweeps.moe_grouped_sweep import graph_us

NUM_E, TOP_K, HIDDEN, INTER, LAYERS = 128, 8, 2048, 768, 4
GEMV_GATE_UP = [
    dict(gate_up_n=n, gate_up_words=w, num_warps=warps)
    for n, w, warps in itertools.product((2, 4, 8), (128, 256), (1, 2, 4))
]
GEMV_DOWN = [dict(down_n=n, down_words=w) for n, w in itertools.product((4, 8, 16), (32, 64, 128))]
GROUPED = [GemmTiles(n, 128, warps, stages)
           for n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]  # fmt: skip


def time_us(tokens: int, weights: list[Any], experts: Callable[..., torch.Tensor]) -> float:
    """A layer's routing and `experts(x, gate_up, down, weights, ids)`, from one CUDA graph."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    logits = [torch.randn(tokens, NUM_E, device="cuda", generator=gen) for _ in weights]

    def run() -> None:
        for layer_logits, (w13, w2) in zip(logits, weights, strict=True):
            routing, ids = ops.moe_route(layer_logits, TOP_K, renormalize=True)
            experts(x, w13, w2, routing, ids)

    return graph_us(run, len(weights), str(tokens))


def sweep_gemv(tokens: int, weights: list[Any], deadline: float) -> dict[str, Any]:
    best, best_us = Int4GemvTiles(), float("inf")
    for candidates in (GEMV_GATE_UP, GEMV_DOWN):
        base = best
        for change in candidates:
            if time.monotonic() > deadline:
                break
            tiles = dataclasses.replace(base, **change)
            us = time_us(tokens, weights, lambda *a, t=tiles: moe_experts_int4_gemv(*a, tiles=t))
            if us < best_us:
                best, best_us = tiles, us
    default = time_us(tokens, weights, moe_experts_int4_gemv)
    grouped = time_us(tokens, weights, moe_experts_int4_grouped)
    return {
        "gemv": dataclasses.asdict(best), "gemv_us": round(best_us, 1),
        "gemv_default_us": round(default, 1), "grouped_default_us": round(grouped, 1),
    }  # fmt: skip


def sweep_grouped(tokens: int, weights: list[Any], deadline: float) -> dict[str, Any]:
    rows = []
    block_m = int4_grouped_tiles(tokens * TOP_K).block_m  # the engine's
    for tiles in GROUPED:
        if time.monotonic() > deadline:
            break
        both = GroupedTiles(block_m, tiles, tiles)
        us = time_us(tokens, weights,
                     lambda *a, t=both: moe_experts_int4_grouped(*a, tiles=t))  # fmt: skip
        rows.append((us, tiles))
    default = time_us(tokens, weights, moe_experts_int4_grouped)
    us, tiles = min(rows, key=lambda row: row[0])
    return {"grouped": dataclasses.asdict(tiles), "grouped_us": round(us, 1),
            "grouped_default_us": round(default, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gemv-tokens", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--grouped-tokens", type=int, nargs="*", default=[64, 256, 1024, 4096])
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--out", type=Path, default=Path("moe_int4_sweep.json"))
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(int4_stack(NUM_E, 2 * INTER, HIDDEN, gen), int4_stack(NUM_E, HIDDEN, INTER, gen))
               for _ in range(LAYERS)]  # fmt: skip
    start, best = time.monotonic(), {}
    per_count = args.budget_s / (len(args.gemv_tokens) + len(args.grouped_tokens))
    for tokens in args.gemv_tokens + args.grouped_tokens:
        sweep = sweep_gemv if tokens in args.gemv_tokens else sweep_grouped
        best[tokens] = sweep(tokens, weights, time.monotonic() + per_count)
        print(tokens, best[tokens], f"{time.monotonic() - start:.0f} s", flush=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "best": best},
                                       indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
