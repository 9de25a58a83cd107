"""int4 (W4A16) linear layers at 8B shapes: Triton tile configs against bf16 and the floor.

For each projection of --model and each M in --m, times `kernels.triton_int4.int4_linear` with
every config of CANDIDATES (groups of 128, asymmetric, as AWQ writes them), bf16 through
`kernels.ops.linear` (what the engine runs), and reports microseconds per call and the GB/s of
packed weights, scales and zero points read. Timing is linear_sweep's: a CUDA graph calls the
layer once per layer copy, so each weight comes from HBM. Every config is first checked against
the reference (relative error < 2e-2). `triton_int4.default_tiles` holds the picks.

    python3 benchmarks/int4_sweep.py --out $OUT/int4_sweep.json --m 1 4 16 64 256

Needs a CUDA GPU and ~12 GB of its memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.linear_sweep import (  # noqa: E402
    DEVICE,
    FLOOR_BYTES_PER_S,
    MODEL_LAYERS,
    MODEL_SHAPES,
    Shape,
    rel_error,
    time_layer,
)
from kernels import ops  # noqa: E402
from kernels.int4 import int4_linear_reference, quantize_int4_reference  # noqa: E402
from kernels.triton_int4 import Int4Tiles, default_tiles, int4_linear  # noqa: E402

GROUP = 128
MAX_REL_ERR = 2e-2
# (block_m, block_n, block_k, num_warps, num_stages, use_dot); block_m is raised to the row tile
# the M needs (16 for tl.dot; next power of two for fma).
CANDIDATES = [Int4Tiles(*c) for c in [
    (1, 4, 512, 2, 4, False), (1, 8, 512, 4, 4, False), (1, 4, 1024, 4, 3, False),
    (1, 8, 256, 2, 4, False), (1, 16, 512, 4, 3, False), (1, 2, 1024, 2, 4, False),
    (1, 8, 1024, 4, 3, False), (1, 4, 256, 2, 6, False),
    (16, 32, 128, 4, 4, True), (16, 64, 128, 4, 4, True), (16, 128, 128, 8, 3, True),
    (16, 32, 256, 4, 4, True), (16, 64, 256, 4, 3, True), (16, 32, 512, 4, 3, True),
    (16, 16, 512, 4, 4, True), (16, 16, 256, 2, 4, True),
]]  # fmt: skip


def tiles_for(tiles: Int4Tiles, m: int) -> Int4Tiles | None:
    """The candidate at M rows, or None where it does not apply."""
    rows = 1 << (m - 1).bit_length()
    if not tiles.use_dot:
        if rows * tiles.block_n * tiles.block_k // 8 > 128 * 32 * tiles.num_warps:
            return None  # the [BM, BN, BK] accumulator would spill
        return dataclasses.replace(tiles, block_m=rows)
    return None if m > 64 else tiles


def label(tiles: Int4Tiles) -> str:
    kind = "dot" if tiles.use_dot else "fma"
    return (
        f"{kind} m{tiles.block_m} n{tiles.block_n} k{tiles.block_k} "
        f"w{tiles.num_warps} s{tiles.num_stages}"
    )


def make_layers(shape: Shape, copies: int) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator(device=DEVICE).manual_seed(shape.n)
    layers = []
    for _ in range(copies):
        weight = torch.randn(shape.n, shape.k, generator=gen, device=DEVICE) * shape.k**-0.5
        qweight, scales, zeros = quantize_int4_reference(weight, GROUP, symmetric=False)
        layers.append((qweight, scales.to(torch.bfloat16), zeros))
    return layers


def sweep_shape(shape: Shape, ms: list[int], copies: int) -> list[dict[str, Any]]:
    layers = make_layers(shape, copies)
    packed_bytes = sum(t.numel() * t.element_size() for t in layers[0] if t is not None)
    bf16 = [torch.randn(shape.n, shape.k, device=DEVICE).to(torch.bfloat16) for _ in range(copies)]
    rows = []
    for m in ms:
        x = torch.randn(m, shape.k, device=DEVICE).to(torch.bfloat16)
        rows.append(
            row(shape, m, "bf16", time_layer(ops.linear, x, bf16), bf16[0].numel() * 2, None)
        )
        expected = int4_linear_reference(x, *layers[0], GROUP)
        candidates = [t for c in CANDIDATES if (t := tiles_for(c, m)) is not None]
        if m > 64:  # the engine dequantizes, then cuBLAS: one row, from int4_linear itself
            fn = functools.partial(_int4, tiles=None)
            seconds = time_layer(fn, x, layers)  # type: ignore[arg-type]
            rows.append(row(shape, m, "dequantize + cuBLAS", seconds, packed_bytes, None))
            continue
        for tiles in [default_tiles(m, shape.n, shape.k), *candidates]:
            fn = functools.partial(_int4, tiles=tiles)
            try:
                error = rel_error(fn(x, layers[0]), expected)
                if not error < MAX_REL_ERR:
                    raise ValueError(f"relative error {error:.2e}")
                seconds = time_layer(fn, x, layers)  # type: ignore[arg-type]
            except Exception as exc:
                print(f"  {shape.name} M={m} {label(tiles)}: skipped ({exc})"[:160])
                continue
            rows.append(row(shape, m, label(tiles), seconds, packed_bytes, tiles))
        best = min((r for r in rows if r["m"] == m and r["impl"] != "bf16"), key=lambda r: r["us"])
        print(f"{shape.name:8} M={m:<4} best {best['impl']}: {best['us']:.1f} us")
    return rows


def _int4(
    x: torch.Tensor, layer: tuple[torch.Tensor, ...], tiles: Int4Tiles | None
) -> torch.Tensor:
    qweight, scales, zeros = layer
    return int4_linear(x, qweight, scales, zeros, GROUP, tiles=tiles)


def row(
    shape: Shape, m: int, impl: str, seconds: float, weight_bytes: int, tiles: Int4Tiles | None
) -> dict[str, Any]:
    return {
        "shape": shape.name,
        "m": m,
        "impl": impl,
        "tiles": dataclasses.asdict(tiles) if tiles is not None else None,
        "us": seconds * 1e6,
        "weight_gb_per_s": weight_bytes / seconds / 1e9,
        "floor_us": weight_bytes / FLOOR_BYTES_PER_S * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="llama")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 32, 64, 256])
    parser.add_argument("--copies", type=int, default=8, help="weight copies (past the L2)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    shapes = [s for s in MODEL_SHAPES[args.model] if s.name != "lm_head"]
    rows = [r for shape in shapes for r in sweep_shape(shape, args.m, args.copies)]
    device = torch.cuda.get_device_name()
    result = {"device": device, "model": args.model, "layers": MODEL_LAYERS[args.model]}
    args.out.write_text(json.dumps({**result, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
