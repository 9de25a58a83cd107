"""FP8 (W8A8) decode-sized linear layers at 8B shapes: GEMV tiles against the defaults and bf16.

For each projection of --model and each M in --m, times `fp8_skinny_linear` (the activation
quantization and the FP8 GEMV, as `kernels.quantized_ops.fp8_linear` runs them up to 64 rows) with
`fp8_default_tiles` and with every config of CANDIDATES, cuBLASLt's scaled
GEMM (what the engine runs past 64 rows) and bf16 through `kernels.ops.linear`; reports
microseconds per call and GB/s of FP8 weights (timing and checks:
sweeps/quantized_sweep.py). With --quantized-rows the FP8 layers take rows quantized
before the timing, as the engine's norms and SiLU hand them to qkv, gate_up and down.

    python -m sweeps.fp8_sweep --out $OUT/fp8_sweep.json --m 1 4 16 [--quantized-rows]

Needs a CUDA GPU and ~8 GB of its memory.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kernels.fp8 import (
    Fp8Rows,
    fp8_linear_reference,
    quantize_fp8_rowwise_reference,
)
from kernels.triton_fp8 import (
    Fp8Tiles,
    fp8_default_tiles,
    fp8_skinny_linear,
    quantize_fp8_rowwise,
)
from kernels.triton_stages import exact_stages
from sweeps import quantized_sweep
from sweeps.linear_sweep import DEVICE, Shape

# The FP8 GEMV's (block_n, block_k, num_warps, num_stages), each with K in 1, 2, 4 and 8 splits
# (no more splits than K steps; with uneven steps the last splits may get one or none).
CANDIDATES = [
    (64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3), (64, 256, 4, 4), (64, 256, 4, 6),
    (64, 512, 4, 3), (64, 512, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3), (128, 256, 8, 4),
    (128, 256, 4, 4),
]  # fmt: skip


def candidates(m: int, k: int) -> list[Fp8Tiles]:
    block_m = fp8_default_tiles(m, 1, k).block_m
    return [
        Fp8Tiles(block_m, block_n, block_k, warps, stages, split)
        for block_n, block_k, warps, stages in CANDIDATES
        for split in (1, 2, 4, 8)
        if split <= k // block_k
    ]


def label(tiles: Fp8Tiles) -> str:
    return (
        f"m{tiles.block_m} n{tiles.block_n} k{tiles.block_k} w{tiles.num_warps}"
        f" s{tiles.num_stages} split{tiles.split_k}"
    )


def sweep_shape(
    shape: Shape, ms: list[int], copies: int, quantized_rows: bool = False
) -> list[dict[str, Any]]:
    gen = torch.Generator(device=DEVICE).manual_seed(shape.n)
    layers = []
    for _ in range(copies):
        weight = torch.randn(shape.n, shape.k, generator=gen, device=DEVICE) * shape.k**-0.5
        qweight, scale = quantize_fp8_rowwise_reference(weight)
        layers.append((qweight, scale[:, 0].contiguous()))
    fp8_bytes = shape.n * shape.k + shape.n * 4
    rows = []
    for m in ms:
        x = torch.randn(m, shape.k, device=DEVICE).to(torch.bfloat16)
        rows.append(quantized_sweep.bf16_row(shape, m, x, copies))
        named = [("default", fp8_default_tiles(m, shape.n, shape.k))]
        named += [(label(t), t) for t in candidates(m, shape.k)]
        rows_q = Fp8Rows(*quantize_fp8_rowwise(x), x.dtype) if quantized_rows else None
        configs = [(name, functools.partial(_fp8, tiles=t, rows_q=rows_q), t) for name, t in named]
        cublaslt = functools.partial(_cublaslt, rows_q=rows_q)
        configs.append(("cublaslt", cublaslt, None))  # quantized_ops.fp8_linear past 64 rows
        expected = fp8_linear_reference(x, *layers[0])
        rows += quantized_sweep.time_configs(shape, x, layers, expected, configs, fp8_bytes)
        quantized_sweep.print_best(shape, m, rows)
    return rows


def _cublaslt(
    x: torch.Tensor, layer: tuple[torch.Tensor, ...], rows_q: Fp8Rows | None
) -> torch.Tensor:
    """The quantization kernel (unless rows_q), then cuBLASLt's row-wise scaled FP8 GEMM."""
    qweight, scale = layer
    qx, x_scale = (rows_q.q, rows_q.scale) if rows_q is not None else quantize_fp8_rowwise(x)
    return torch._scaled_mm(
        qx, qweight.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=x.dtype
    )


def _fp8(
    x: torch.Tensor,
    layer: tuple[torch.Tensor, ...],
    tiles: Fp8Tiles,
    rows_q: Fp8Rows | None,  # x quantized before the timing
) -> torch.Tensor:
    qweight, scale = layer
    return fp8_skinny_linear(rows_q if rows_q is not None else x, qweight, scale, tiles=tiles)


if __name__ == "__main__":
    description = __doc__.split("\n\n")[0]
    args = quantized_sweep.parse_args(
        description,
        [1, 4, 16],
        lambda parser: parser.add_argument("--quantized-rows", action="store_true"),
    )
    sweep = functools.partial(sweep_shape, quantized_rows=args.quantized_rows)
    with exact_stages():  # a candidate runs as labelled, or is skipped as not fitting
        quantized_sweep.run(args, sweep, with_lm_head=False)
