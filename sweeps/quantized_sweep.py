"""What the quantized-layer sweeps share (sweeps/int4_sweep.py, sweeps/fp8_sweep.py):
a bf16 baseline per cell, each config checked against the reference then timed with
linear_sweep's CUDA-graph timing over per-layer weight copies (so each weight comes from HBM),
one JSON row per timing, and the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kernels import ops
from sweeps.linear_sweep import (
    DEVICE,
    FLOOR_BYTES_PER_S,
    MODEL_LAYERS,
    MODEL_SHAPES,
    Shape,
    rel_error,
    time_layer,
)

MAX_REL_ERR = 2e-2
Layer = Callable[[torch.Tensor, Any], torch.Tensor]  # (x, one layer copy's tensors) -> out


def row(
    shape: Shape, m: int, impl: str, seconds: float, weight_bytes: int, tiles: Any = None
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


def bf16_row(shape: Shape, m: int, x: torch.Tensor, copies: int) -> dict[str, Any]:
    """The engine's bf16 layer (`ops.linear`) at the same shape and M."""
    weights = [
        torch.randn(shape.n, shape.k, device=DEVICE).to(torch.bfloat16) for _ in range(copies)
    ]
    return row(shape, m, "bf16", time_layer(ops.linear, x, weights), shape.n * shape.k * 2)


def time_configs(
    shape: Shape,
    x: torch.Tensor,
    layers: list[Any],
    expected: torch.Tensor,
    configs: list[tuple[str, Layer, Any]],  # (name, layer function, tiles or None)
    weight_bytes: int,
) -> list[dict[str, Any]]:
    """A row per config that matches the reference; the others are reported and skipped."""
    m, rows = x.shape[0], []
    for name, fn, tiles in configs:
        try:
            error = rel_error(fn(x, layers[0]), expected)
            if not error < MAX_REL_ERR:
                raise ValueError(f"relative error {error:.2e}")
            seconds = time_layer(fn, x, layers)  # type: ignore[arg-type]
        except Exception as exc:
            print(f"  {shape.name} M={m} {name}: skipped ({exc})"[:160])
            continue
        rows.append(row(shape, m, name, seconds, weight_bytes, tiles))
    return rows


def print_best(shape: Shape, m: int, rows: list[dict[str, Any]]) -> None:
    best = min((r for r in rows if r["m"] == m and r["impl"] != "bf16"), key=lambda r: r["us"])
    print(f"{shape.name:8} M={m:<4} best {best['impl']}: {best['us']:.1f} us", flush=True)


SweepShape = Callable[[Shape, list[int], int], list[dict[str, Any]]]  # (shape, Ms, copies)


def main(
    description: str, sweep_shape: SweepShape, default_ms: list[int], with_lm_head: bool
) -> None:
    run(parse_args(description, default_ms), sweep_shape, with_lm_head)


def parse_args(
    description: str,
    default_ms: list[int],
    more: Callable[[argparse.ArgumentParser], None] | None = None,  # a sweep's own flags
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="llama")
    parser.add_argument("--m", type=int, nargs="+", default=default_ms)
    parser.add_argument("--copies", type=int, default=8, help="weight copies (past the L2)")
    parser.add_argument("--out", type=Path, required=True)
    if more is not None:
        more(parser)
    return parser.parse_args()


def run(args: argparse.Namespace, sweep_shape: SweepShape, with_lm_head: bool) -> None:
    """Every shape of the model through `sweep_shape`; the rows as JSON in args.out."""
    shapes = [s for s in MODEL_SHAPES[args.model] if with_lm_head or s.name != "lm_head"]
    rows = [r for shape in shapes for r in sweep_shape(shape, args.m, args.copies)]
    result = {
        "device": torch.cuda.get_device_name(),
        "model": args.model,
        "layers": MODEL_LAYERS[args.model],
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1))
