"""MXFP4 experts at gpt-oss-20b's layer shape (GPU): the GEMVs' and the grouped GEMMs' tiles,
and each against bf16 experts, by token count:

    python3 -m sweeps.mxfp4_gemv_sweep --out mxfp4_gemv_sweep.jsonl

One layer's experts (32 of 2880 columns over 2880, top 4, gpt-oss's biases and clamped
SwiGLU), microseconds by `triton.testing.do_bench` (which flushes the L2 between runs), over
four layers' weights in turn; the floor is the chosen experts' codes and scales. Random codes
and scales of 2 ** -8 .. 2 ** -3 (the kernels' time does not depend on the values).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from kernels.int4 import Int4Stack
from kernels.moe import ClampedSwiglu, ExpertBiases, moe_route_reference
from kernels.triton_moe import moe_experts
from kernels.triton_moe_int4 import INT4_TILES, int4_grouped_tiles, moe_experts_int4_grouped
from kernels.triton_moe_int4_gemv import (
    MXFP4_GEMV_MAX_PAIRS,
    Int4GemvTiles,
    moe_experts_int4_gemv,
)
from kernels.triton_moe_tiles import GemmTiles, GroupedTiles

EXPERTS, HIDDEN, INTER, TOP_K, COPIES = 32, 2880, 2880, 4, 4
CANDIDATES = [
    Int4GemvTiles(gate_up_n=n, gate_up_words=w, down_n=n, down_words=dw, num_warps=warps)
    for n, w, dw, warps in itertools.product((4, 8, 16), (32, 64, 128, 256), (32, 64, 128), (2, 4))
    if dw <= w
]  # fmt: skip
# The grouped GEMMs' (kernels/triton_moe_int4.py's INT4_TILES first): weight rows a program, K a
# step (the largest of it and 64 that divides K: 64 at gpt-oss's 2,880 columns; MXFP4 steps of
# 128 or 256 with a masked tail were 1.4-1.5x slower at 32 and 128 tokens, H100, 2026-12-06),
# warps, stages; both GEMMs alike.
GROUPED = [INT4_TILES] + [
    tiles
    for n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))
    if (tiles := GemmTiles(n=n, k=128, num_warps=warps, num_stages=stages)) != INT4_TILES
]  # fmt: skip
# Pairs a block (each expert's group padded to it): the engine's by the pair count, then these.
# MXFP4's grouped GEMMs decode each weight tile once a block, so fewer, fuller blocks may pay
# where the bf16 experts' bandwidth-bound choice does not.
BLOCK_M = (16, 32, 64)


def mxfp4_stack(rows: int, cols: int) -> Int4Stack:
    codes = torch.randint(-(2**31), 2**31 - 1, (EXPERTS, rows, cols // 8), dtype=torch.int32,
                          device="cuda")  # fmt: skip
    exponents = torch.randint(-8, -2, (EXPERTS, rows, cols // 32), device="cuda").float()
    return Int4Stack(codes, torch.exp2(exponents).to(torch.bfloat16), None, 32, e2m1=True)


def time_us(layer: Callable[[int], torch.Tensor]) -> float:
    """A layer's experts, the weights of each call the next of COPIES."""
    calls = itertools.count()
    return round(triton.testing.do_bench(lambda: layer(next(calls)), warmup=30, rep=150) * 1e3, 1)


Layers = list[tuple[Int4Stack, Int4Stack]]


def measure(tokens: int, layers: Layers, floats: list[tuple[torch.Tensor, torch.Tensor]],
            biases: ExpertBiases, swiglu: ClampedSwiglu) -> dict[str, object]:  # fmt: skip
    """One token count: the floor, every grouped GEMM tile set, bf16 experts, and the GEMV
    tile sets (past twice the GEMVs' pair bound, only the first)."""
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, device="cuda")
    weights, ids = moe_route_reference(logits, TOP_K, renormalize=True)
    chosen = ids.unique().numel()
    row: dict[str, object] = dict(tokens=tokens, experts_chosen=chosen)
    row["floor_bytes"] = chosen * 3 * HIDDEN * INTER * 18 // 32  # codes, bf16 scales
    grouped = {}
    block = int4_grouped_tiles(tokens * TOP_K).block_m
    candidates = [(block, gemm) for gemm in GROUPED]
    candidates += [(other, INT4_TILES) for other in BLOCK_M if other != block]
    for block_m, gemm in candidates:
        tiles = GroupedTiles(block_m, gemm, gemm)
        grouped[json.dumps(dataclasses.asdict(tiles))] = time_us(
            lambda i, tiles=tiles: moe_experts_int4_grouped(
                x, *layers[i % COPIES], weights, ids, tiles, biases=biases, swiglu=swiglu
            )
        )
    best_grouped = min(grouped, key=grouped.__getitem__)
    row["grouped_us"] = next(iter(grouped.values()))  # the default tiles'
    row.update(grouped_best=json.loads(best_grouped), grouped_best_us=grouped[best_grouped])
    row["bf16_us"] = time_us(
        lambda i: moe_experts(x, *floats[i % 2], weights, ids, biases=biases, swiglu=swiglu)
    )
    gemv = {}
    for tiles in CANDIDATES if tokens * TOP_K <= 2 * MXFP4_GEMV_MAX_PAIRS else CANDIDATES[:1]:
        gemv[json.dumps(dataclasses.asdict(tiles))] = time_us(
            lambda i, tiles=tiles: moe_experts_int4_gemv(
                x, *layers[i % COPIES], weights, ids, tiles=tiles, biases=biases, swiglu=swiglu
            )
        )
    best = min(gemv, key=gemv.__getitem__)
    row.update(gemv_best=json.loads(best), gemv_best_us=gemv[best], gemv_us=gemv,
               grouped_tiles_us=grouped)  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 32, 128])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    layers = [(mxfp4_stack(2 * INTER, HIDDEN), mxfp4_stack(HIDDEN, INTER)) for _ in range(COPIES)]
    floats = [(torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16),
               torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16))
              for _ in range(2)]  # fmt: skip
    biases = ExpertBiases(*(torch.zeros(EXPERTS, n, device="cuda", dtype=torch.bfloat16)
                            for n in (2 * INTER, HIDDEN)))  # fmt: skip
    with args.out.open("w") as out:
        for tokens in args.tokens:
            row = measure(tokens, layers, floats, biases, ClampedSwiglu(7.0))
            brief = {k: v for k, v in row.items() if k not in ("gemv_us", "grouped_tiles_us")}
            print(json.dumps(brief), flush=True)
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
