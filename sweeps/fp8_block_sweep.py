"""Block-scaled FP8 linear layers at 8B shapes (128 x 128 blocks): tile configs against bf16,
per-channel FP8 (what `--quantization fp8` runs) and the floor.

For each projection of --model and each M in --m, times `kernels.triton_fp8.fp8_group_linear`
(the activation quantized per token and group, then the kernel) with every config of
CANDIDATES, bf16 through `kernels.ops.linear` and per-channel FP8 through
`kernels.quantized_ops.fp8_linear`; reports microseconds per call and the GB/s of FP8 weights
and scales (timing and checks: sweeps/quantized_sweep.py).

    python -m sweeps.fp8_block_sweep --out $OUT/fp8_block_sweep.json --m 1 16 256 2048

Needs a CUDA GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kernels import quantized_ops
from kernels.fp8 import (
    fp8_group_linear_reference,
    quantize_fp8_blockwise_reference,
    quantize_fp8_rowwise_reference,
)
from kernels.triton_fp8 import Fp8GroupTiles, fp8_group_linear
from sweeps import quantized_sweep
from sweeps.linear_sweep import DEVICE, Shape

GROUP = 128
# (block_m, block_n, num_warps, num_stages)
CANDIDATES = [Fp8GroupTiles(*c) for c in [
    (16, 32, 4, 4), (16, 64, 4, 3), (16, 64, 4, 5), (16, 128, 4, 4), (16, 128, 8, 3),
    (32, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 8, 3), (64, 128, 4, 4),
    (128, 128, 8, 3), (128, 128, 4, 3), (128, 64, 4, 4), (128, 256, 8, 3), (64, 256, 8, 3),
]]  # fmt: skip


def label(tiles: Fp8GroupTiles) -> str:
    return f"m{tiles.block_m} n{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}"


def sweep_shape(shape: Shape, ms: list[int], copies: int) -> list[dict[str, Any]]:
    gen = torch.Generator(device=DEVICE).manual_seed(shape.n)
    weights = [
        torch.randn(shape.n, shape.k, generator=gen, device=DEVICE) * shape.k**-0.5
        for _ in range(copies)
    ]
    blocks = [quantize_fp8_blockwise_reference(w, (GROUP, GROUP)) for w in weights]
    channels = [quantize_fp8_rowwise_reference(w) for w in weights]
    channels = [(q, s[:, 0].contiguous()) for q, s in channels]
    del weights
    fp8_bytes = shape.n * shape.k + blocks[0][1].numel() * 4
    rows = []
    for m in ms:
        x = torch.randn(m, shape.k, device=DEVICE).to(torch.bfloat16)
        rows.append(quantized_sweep.bf16_row(shape, m, x, copies))
        expected = fp8_group_linear_reference(x, *blocks[0], GROUP)
        per_channel = [("fp8 per channel", _per_channel, None)]
        rows += quantized_sweep.time_configs(
            shape, x, channels, quantized_ops.fp8_linear(x, *channels[0]), per_channel, fp8_bytes
        )
        if m > 16:  # what the engine runs there: cuBLASLt's blockwise-scaled GEMM
            cublas = [("cuBLASLt blockwise", _cublas, None)]
            cublas_layers = [(q, s, s[::128].contiguous()) for q, s in blocks]
            rows += quantized_sweep.time_configs(
                shape, x, cublas_layers, expected, cublas, fp8_bytes
            )
        configs = [(label(t), functools.partial(_block, tiles=t), t) for t in CANDIDATES]
        rows += quantized_sweep.time_configs(shape, x, blocks, expected, configs, fp8_bytes)
        quantized_sweep.print_best(shape, m, rows)
    return rows


def _block(x: torch.Tensor, layer: Any, tiles: Fp8GroupTiles) -> torch.Tensor:
    return fp8_group_linear(x, *layer, GROUP, tiles=tiles)


def _cublas(x: torch.Tensor, layer: Any) -> torch.Tensor:
    qweight, weight_scale, block_scale = layer
    return quantized_ops.fp8_group_linear(x, qweight, weight_scale, GROUP, None, block_scale)


def _per_channel(x: torch.Tensor, layer: Any) -> torch.Tensor:
    return quantized_ops.fp8_linear(x, *layer)


if __name__ == "__main__":
    description = __doc__.split("\n\n")[0]
    quantized_sweep.main(description, sweep_shape, [1, 16, 256, 2048], with_lm_head=False)
