"""The MoE grouped GEMMs' tiles (kernels/triton_moe_tiles.py, `GROUPED_TILES` and, with --fp8,
`GROUPED_TILES_FP8`) by token count, at Qwen3-30B-A3B's layer shape (GPU):

    python3 -m sweeps.moe_grouped_sweep --out moe_grouped_sweep.json [--fp8]

For each token count: each GEMM's group_m (how many blocks of pairs the programs take at a
time) and swap_ab (its products transposed, weights first); then, for each block_m that suits
the count, a coordinate descent: the gate/up GEMM's tiles with the down GEMM's as they stand,
then the down GEMM's with the best gate/up; then group_m and swap_ab again (--groups-only:
those alone). Each figure is a layer's routing and experts, microseconds, from one CUDA graph
over 4 layers of weights (as `kvflow bench moe`, with fewer repeats). A time budget stops the
sweep early; what was measured is written either way.
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
from triton.testing import do_bench

from benchmarks.moe_bench import fp8_rows
from kernels import ops
from kernels.triton_moe import moe_experts_grouped
from kernels.triton_moe_tiles import GemmTiles, GroupedTiles, grouped_tiles
from kernels.triton_stages import exact_stages

NUM_E, TOP_K, HIDDEN, INTER, LAYERS = 128, 8, 2048, 768, 4
# block_m worth trying by tokens (top 8 of 128 experts: an expert holds 1/16 of the tokens)
BLOCK_M = {16: (16,), 64: (16, 32), 256: (16, 32, 64), 1024: (32, 64), 4096: (64, 128),
           16384: (64, 128)}  # fmt: skip
CANDIDATES = [
    GemmTiles(n, k, warps, stages)
    for n, k, warps, stages in itertools.product((64, 128), (64, 128, 256), (4, 8), (2, 3, 4))
    if not (n == 128 and k == 256 and stages == 4)  # past an H200's shared memory at block 128
]
# FP8 tiles take half the shared memory: the widest K steps fit in four stages too.
CANDIDATES_FP8 = [
    GemmTiles(n, k, warps, stages)
    for n, k, warps, stages in itertools.product((64, 128), (64, 128, 256), (4, 8), (2, 3, 4))
]
# blocks of pairs a group of programs takes (1 << 16: every block, a column tile at a time)
GROUP_M = (1, 2, 4, 8, 16, 32, 1 << 16)
Weights = list[tuple[torch.Tensor, ...]]


class Layers:
    """A token count's inputs over LAYERS layers of weights, and a tile set's time a layer."""

    def __init__(self, tokens: int, weights: Weights, randn: Any) -> None:
        self.tokens, self.weights = tokens, weights
        self.x = randn(tokens, HIDDEN)
        self.logits = [randn(tokens, NUM_E) for _ in weights]
        self.rows: list[dict[str, Any]] = []

    def us(self, tiles: GroupedTiles) -> float:
        def run() -> None:
            for logits, (w13, w2, *scales) in zip(self.logits, self.weights, strict=True):
                routing, ids = ops.moe_route(logits, TOP_K, renormalize=True)
                moe_experts_grouped(self.x, w13, w2, routing, ids, tiles, *scales)

        us = graph_us(run, len(self.weights), f"{self.tokens} {tiles}")
        if us < float("inf"):
            row = {"tokens": self.tokens, "tiles": dataclasses.asdict(tiles), "us": us}
            self.rows.append(row)
        return us


def graph_us(run: Callable[[], None], layers: int, label: str) -> float:
    """Microseconds a layer of `run` (over `layers` layers), replayed from one CUDA graph; a
    run that fails (out of shared memory, ...) is reported under `label`, and infinite."""
    try:
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        ms = float(do_bench(graph.replay, warmup=10, rep=40, return_mode="median"))
    except Exception as exc:  # reported, not fatal
        print(label, repr(exc)[:160], flush=True)
        return float("inf")
    return 1000 * ms / layers


def descend(layers: Layers, deadline: float, fp8: bool, groups_only: bool) -> dict[str, Any]:
    default = grouped_tiles(layers.tokens * TOP_K, fp8)
    best = Best(default, layers.us(default))
    best.groups(layers, deadline)
    block_ms = () if groups_only else BLOCK_M.get(layers.tokens, (default.block_m,))
    for block_m in block_ms:
        for field in ("gate_up", "down"):
            base = dataclasses.replace(best.tiles, block_m=block_m)
            order = getattr(base, field)
            for candidate in CANDIDATES_FP8 if fp8 else CANDIDATES:
                if time.monotonic() > deadline:
                    break
                candidate = dataclasses.replace(
                    candidate, group_m=order.group_m, swap_ab=order.swap_ab
                )
                best.keep(layers, dataclasses.replace(base, **{field: candidate}))
    if block_ms:
        best.groups(layers, deadline)
    return {"tiles": dataclasses.asdict(best.tiles), "us": round(best.us, 1),
            "default_us": round(best.default_us, 1)}  # fmt: skip


class Best:
    """The fastest tile set so far, and the time of the one it started from."""

    def __init__(self, tiles: GroupedTiles, us: float) -> None:
        self.tiles, self.us, self.default_us = tiles, us, us

    def keep(self, layers: Layers, tiles: GroupedTiles) -> None:
        us = layers.us(tiles)
        if us < self.us:
            self.tiles, self.us = tiles, us

    def groups(self, layers: Layers, deadline: float) -> None:
        """Each GEMM's blocks a group of programs (kernels/triton_moe.block_tile), and its
        products as they are or transposed (tile_product)."""
        for field in ("gate_up", "down"):
            for swap_ab, group_m in itertools.product((False, True), GROUP_M):
                if time.monotonic() > deadline:
                    return
                gemm = getattr(self.tiles, field)
                gemm = dataclasses.replace(gemm, group_m=group_m, swap_ab=swap_ab)
                self.keep(layers, dataclasses.replace(self.tiles, **{field: gemm}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 16384, 1024, 64, 4096, 16])
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument("--out", type=Path, default=Path("moe_grouped_sweep.json"))
    parser.add_argument("--fp8", action="store_true", help="FP8 experts, a scale a row (W8A8)")
    parser.add_argument("--groups-only", action="store_true",
                        help="each GEMM's group_m and swap_ab only")  # fmt: skip
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    weights = [
        (randn(NUM_E, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
         randn(NUM_E, HIDDEN, INTER, scale=INTER**-0.5))
        for _ in range(LAYERS)
    ]  # fmt: skip
    if args.fp8:
        weights = [(*fp8_rows(w13), *fp8_rows(w2)) for w13, w2 in weights]
        weights = [(w13, w2, s13, s2) for w13, s13, w2, s2 in weights]
    start, best, rows = time.monotonic(), {}, []
    with exact_stages():  # a candidate runs as labelled, or is skipped as not fitting
        sweep(args, weights, randn, start, best, rows)


def sweep(args: argparse.Namespace, weights: Weights, randn: Any, start: float,
          best: dict[int, Any], rows: list[dict[str, Any]]) -> None:  # fmt: skip
    """Each token count's descent in turn, the results written after each."""
    for tokens in args.tokens:
        layers = Layers(tokens, weights, randn)
        deadline = start + args.budget_s
        best[tokens] = descend(layers, deadline, args.fp8, args.groups_only)
        rows += layers.rows
        print(tokens, best[tokens], f"{time.monotonic() - start:.0f} s", flush=True)
        result = {"device": torch.cuda.get_device_name(), "fp8": args.fp8, "best": best,
                  "rows": rows}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
