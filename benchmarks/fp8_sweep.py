"""FP8 (W8A8) skinny linear layers at 8B shapes: tile configs against the defaults and bf16.

For each projection of --model and each M in --m, times `fp8_skinny_linear` (the activation
quantization and the skinny kernel, as `kernels.ops.fp8_linear` runs them up to 64 rows) with
`fp8_default_tiles` and with every config of CANDIDATES, cuBLASLt's scaled GEMM (what the
engine runs past 64 rows) and bf16 through `kernels.ops.linear`; reports microseconds per call
and GB/s of FP8 weights (timing and checks: benchmarks/quantized_sweep.py).

    python3 benchmarks/fp8_sweep.py --out $OUT/fp8_sweep.json --m 1 4 16

Needs a CUDA GPU and ~8 GB of its memory.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import quantized_sweep  # noqa: E402
from benchmarks.linear_sweep import DEVICE, Shape, label  # noqa: E402
from kernels.fp8 import fp8_linear_reference, quantize_fp8_rowwise_reference  # noqa: E402
from kernels.triton_fp8 import (  # noqa: E402
    fp8_default_tiles,
    fp8_skinny_linear,
    quantize_fp8_rowwise,
)
from kernels.triton_linear import LinearTiles  # noqa: E402
from kernels.triton_stages import exact_stages  # noqa: E402

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
    fp8_bytes = shape.n * shape.k + shape.n * 4
    rows = []
    for m in ms:
        x = torch.randn(m, shape.k, device=DEVICE).to(torch.bfloat16)
        rows.append(quantized_sweep.bf16_row(shape, m, x, copies))
        named = [("default", fp8_default_tiles(m, shape.n, shape.k))]
        named += [(label(t), t) for t in CANDIDATES if applies(t, m)]
        configs = [(name, functools.partial(_fp8, tiles=t), t) for name, t in named]
        configs.append(("cublaslt", _cublaslt, None))  # what ops.fp8_linear runs past 64 rows
        expected = fp8_linear_reference(x, *layers[0])
        rows += quantized_sweep.time_configs(shape, x, layers, expected, configs, fp8_bytes)
        quantized_sweep.print_best(shape, m, rows)
    return rows


def _cublaslt(x: torch.Tensor, layer: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The quantization kernel, then cuBLASLt's row-wise scaled FP8 GEMM."""
    qweight, scale = layer
    qx, x_scale = quantize_fp8_rowwise(x)
    return torch._scaled_mm(
        qx, qweight.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=x.dtype
    )


def _fp8(x: torch.Tensor, layer: tuple[torch.Tensor, ...], tiles: LinearTiles) -> torch.Tensor:
    qweight, scale = layer
    return fp8_skinny_linear(x, qweight, scale, tiles=tiles)


if __name__ == "__main__":
    description = __doc__.split("\n\n")[0]
    with exact_stages():  # a candidate runs as labelled, or is skipped as not fitting
        quantized_sweep.main(description, sweep_shape, [1, 4, 16], with_lm_head=True)
