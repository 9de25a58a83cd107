"""FP8 (W8A8) skinny linear layers at 8B shapes: tile configs against the defaults and bf16.

For each projection of --model and each M in --m, times `fp8_skinny_linear` (the activation
quantization and the skinny kernel, as `kernels.ops.fp8_linear` runs them up to 16 rows) with
`fp8_default_tiles` and with every config of CANDIDATES, and bf16 through `kernels.ops.linear`;
reports microseconds per call and GB/s of FP8 weights. Timing is linear_sweep's (a CUDA graph
over per-layer weight copies, so each weight comes from HBM); every config is first checked
against the reference (relative error < 2e-2).

    python3 benchmarks/fp8_sweep.py --out $OUT/fp8_sweep.json --m 1 4 16

Needs a CUDA GPU and ~8 GB of its memory.
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
    MODEL_SHAPES,
    Shape,
    label,
    rel_error,
    time_layer,
)
from kernels import ops  # noqa: E402
from kernels.fp8 import fp8_linear_reference, quantize_fp8_rowwise_reference  # noqa: E402
from kernels.triton_fp8 import fp8_default_tiles, fp8_skinny_linear  # noqa: E402
from kernels.triton_linear import LinearTiles  # noqa: E402

MAX_REL_ERR = 2e-2
# (block_n, block_k, num_warps, num_stages, use_dot): FP8 bytes per weight row per step are
# block_k, so these reach twice the K of the bf16 sweep's.
CANDIDATES = [LinearTiles(*c) for c in [
    (16, 512, 4, 4, True), (16, 1024, 4, 3, True), (32, 256, 4, 5, True), (32, 512, 4, 4, True),
    (32, 1024, 4, 3, True), (32, 1024, 8, 3, True), (64, 256, 4, 4, True), (64, 512, 4, 3, True),
    (64, 512, 8, 4, True), (16, 256, 4, 6, True),
    (8, 1024, 4, 3, False), (8, 2048, 4, 2, False), (16, 512, 4, 3, False), (4, 2048, 4, 3, False),
]]  # fmt: skip


def applies(tiles: LinearTiles, m: int) -> bool:
    return tiles.use_dot or tiles.acc_per_thread(m) <= 128


def sweep_shape(shape: Shape, ms: list[int], copies: int) -> list[dict[str, Any]]:
    gen = torch.Generator(device=DEVICE).manual_seed(shape.n)
    layers = []
    for _ in range(copies):
        weight = torch.randn(shape.n, shape.k, generator=gen, device=DEVICE) * shape.k**-0.5
        qweight, scale = quantize_fp8_rowwise_reference(weight)
        layers.append((qweight, scale[:, 0].contiguous()))
    bf16 = [torch.randn(shape.n, shape.k, device=DEVICE).to(torch.bfloat16) for _ in range(copies)]
    fp8_bytes = shape.n * shape.k + shape.n * 4
    rows = []
    for m in ms:
        x = torch.randn(m, shape.k, device=DEVICE).to(torch.bfloat16)
        rows.append(row(shape, m, "bf16", time_layer(ops.linear, x, bf16), shape.n * shape.k * 2))
        expected = fp8_linear_reference(x, *layers[0])
        default = fp8_default_tiles(m, shape.n, shape.k)
        for name, tiles in [("default", default)] + [
            (label(t), t) for t in CANDIDATES if applies(t, m)
        ]:
            fn = functools.partial(_fp8, tiles=tiles)
            try:
                error = rel_error(fn(x, layers[0]), expected)
                if not error < MAX_REL_ERR:
                    raise ValueError(f"relative error {error:.2e}")
                seconds = time_layer(fn, x, layers)  # type: ignore[arg-type]
            except Exception as exc:
                print(f"  {shape.name} M={m} {name}: skipped ({exc})"[:160])
                continue
            rows.append(
                {**row(shape, m, name, seconds, fp8_bytes), "tiles": dataclasses.asdict(tiles)}
            )
        best = min((r for r in rows if r["m"] == m and r["impl"] != "bf16"), key=lambda r: r["us"])
        print(
            f"{shape.name:8} M={m:<3} default {rows_of(rows, m, 'default'):.1f} us, "
            f"best {best['impl']}: {best['us']:.1f} us"
        )
    return rows


def rows_of(rows: list[dict[str, Any]], m: int, impl: str) -> float:
    return next((r["us"] for r in rows if r["m"] == m and r["impl"] == impl), float("nan"))


def _fp8(x: torch.Tensor, layer: tuple[torch.Tensor, ...], tiles: LinearTiles) -> torch.Tensor:
    qweight, scale = layer
    return fp8_skinny_linear(x, qweight, scale, tiles=tiles)


def row(shape: Shape, m: int, impl: str, seconds: float, weight_bytes: int) -> dict[str, Any]:
    return {
        "shape": shape.name,
        "m": m,
        "impl": impl,
        "us": seconds * 1e6,
        "weight_gb_per_s": weight_bytes / seconds / 1e9,
        "floor_us": weight_bytes / FLOOR_BYTES_PER_S * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="llama")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--copies", type=int, default=8, help="weight copies (past the L2)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    shapes = MODEL_SHAPES[args.model]
    rows = [r for shape in shapes for r in sweep_shape(shape, args.m, args.copies)]
    result = {"device": torch.cuda.get_device_name(), "model": args.model, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
