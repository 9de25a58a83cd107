"""GGUF linear layers at 8B shapes: Triton tile configs against bf16 and the floor.

For each projection of --model, each GGUF type of --types and each M in --m, times
`kernels.triton_gguf.gguf_linear` with every config of CANDIDATES on random blocks
(sweeps/gguf_writer.py), bf16 through `kernels.ops.linear`, and reports microseconds per
call and the GB/s of blocks read (timing and checks: sweeps/quantized_sweep.py). Past 64
rows it times what the engine runs there (dequantize, then cuBLAS).

    python -m sweeps.gguf_sweep --out $OUT/gguf_sweep.json --types Q4_K Q6_K --m 1 16

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import numpy as np
import torch

from kernels.gguf import gguf_linear_reference
from kernels.triton_gguf import (
    DEQUANTIZE_ABOVE_ROWS,
    FMA_MAX_ROWS,
    GgufTiles,
    default_tiles,
    gguf_linear,
)
from sweeps import quantized_sweep
from sweeps.gguf_writer import random_weight
from sweeps.linear_sweep import DEVICE, Shape

# (block_m, block_n, num_warps, use_dot, num_stages)
CANDIDATES = [
    GgufTiles(1, n, w, False, stages)
    for n in (2, 4, 8, 16, 32)
    for w in (1, 2, 4, 8)
    for stages in (1, 3)  # no difference found between 1, 2 and 4
    if n * 256 >= 32 * w * 8 and n * 256 <= 32 * w * 64
]  # 8-64 values a thread
CANDIDATES += [GgufTiles(*c) for c in [
    (16, 16, 4, True, 3), (16, 32, 4, True, 3), (16, 64, 4, True, 3), (16, 64, 8, True, 3),
    (16, 32, 4, True, 1), (16, 32, 4, True, 2), (16, 32, 8, True, 4), (32, 32, 4, True, 3),
    (64, 32, 8, True, 3),
]]  # fmt: skip


def tiles_for(tiles: GgufTiles, m: int) -> GgufTiles | None:
    if tiles.use_dot:
        return tiles if FMA_MAX_ROWS < m <= DEQUANTIZE_ABOVE_ROWS else None
    return tiles if m <= FMA_MAX_ROWS else None


def label(tiles: GgufTiles) -> str:
    kind = "dot" if tiles.use_dot else "fma"
    return f"{kind} m{tiles.block_m} n{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}"


def sweep_shape(shape: Shape, qtype: str, ms: list[int], copies: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(shape.n)
    std = shape.k**-0.5
    layers = [
        torch.from_numpy(random_weight(qtype, shape.n, shape.k, std, rng)).to(DEVICE)
        for _ in range(copies)
    ]
    block_bytes = layers[0].numel()
    rows = []
    for m in ms:
        x = torch.randn(m, shape.k, device=DEVICE).to(torch.bfloat16)
        rows.append(quantized_sweep.bf16_row(shape, m, x, copies))
        fn = functools.partial(_gguf, qtype=qtype)
        if m > 64:
            configs = [("dequantize + cuBLAS", functools.partial(fn, tiles=None), None)]
        else:
            tiles = [default_tiles(m)] + [t for c in CANDIDATES if (t := tiles_for(c, m))]
            configs = [(label(t), functools.partial(fn, tiles=t), t) for t in tiles]
        expected = gguf_linear_reference(x, layers[0], qtype)
        timed = quantized_sweep.time_configs(shape, x, layers, expected, configs, block_bytes)
        for r in timed:
            r["qtype"] = qtype
        rows += timed
        quantized_sweep.print_best(shape, m, rows)
    return rows


def _gguf(x: torch.Tensor, raw: torch.Tensor, qtype: str, tiles: GgufTiles | None) -> torch.Tensor:
    return gguf_linear(x, raw, qtype, tiles=tiles)


def main() -> None:
    def types(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])

    args = quantized_sweep.parse_args(__doc__.split("\n\n")[0], [1, 4, 16, 64, 256], types)

    def every_type(shape: Shape, ms: list[int], copies: int) -> list[dict[str, Any]]:
        return [r for qtype in args.types for r in sweep_shape(shape, qtype, ms, copies)]

    quantized_sweep.run(args, every_type, with_lm_head=False)


if __name__ == "__main__":
    main()
