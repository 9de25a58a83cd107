"""int4 (W4A16) linear layers at 8B shapes: Triton tile configs against bf16 and the floor.

For each projection of --model and each M in --m, times `kernels.triton_int4.int4_linear` with
every config of CANDIDATES (groups of 128, asymmetric, as AWQ writes them), bf16 through
`kernels.ops.linear` (what the engine runs), and reports microseconds per call and the GB/s of
packed weights, scales and zero points read (timing and checks: sweeps/quantized_sweep.py).
Past 64 rows it times what the engine runs there (dequantize, then cuBLAS, by slices of the
weight's rows), the Gluon kernel on Hopper's warpgroup MMA with its default tiles
(kernels/gluon_int4.py) and, unless --default-only, the dequantize pass by slices of SLICE_MB
(0: the whole weight), the dot kernel with LARGE_M_CANDIDATES' tiles and the Gluon kernel with
GLUON_CANDIDATES'.
`triton_int4.default_tiles` holds the picks. A peer on the same weights: PyTorch's own int4
GEMM (`torch._weight_int4pack_mm`, gpt-fast's and torchao's "tinygemm"), as a measure of what
a CUDA kernel reaches at these shapes. `--default-only` times the engine's tiles alone.

    python -m sweeps.int4_sweep --out $OUT/int4_sweep.json --m 1 4 16 64 256

Needs a CUDA GPU and ~12 GB of its memory.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch
import triton

from kernels import gluon_int4, triton_int4_dequant
from kernels.int4 import (
    Int4Tiles,
    int4_linear_reference,
    quantize_int4_reference,
    unpack_weight,
)
from kernels.triton_int4 import default_tiles, int4_linear
from sweeps import quantized_sweep
from sweeps.linear_sweep import DEVICE, Shape

GROUP = 128
# (kind, block_m, block_n, block_k, num_warps, num_stages[, split_k]): the rows kernel (timed
# up to 8 rows), the dot kernel (steps of 128 inside a group of 128, one to four an iteration;
# K split over 1-8 programs) and dequant_dot (what act-order runs).
CANDIDATES = [Int4Tiles(*c) for c in [
    *[("rows", 1, bn, bk, w, 1) for bn, bk, w in [
        (2, 1024, 1), (4, 1024, 1), (8, 1024, 1), (4, 2048, 1), (8, 2048, 2), (4, 2048, 2),
        (8, 1024, 2), (16, 1024, 4)]],
    *[("dot", bm, bn, bk, w, 3, split) for bm, bn, bk, w in [
        (8, 16, 128, 1), (8, 32, 128, 2), (16, 32, 128, 2), (8, 64, 128, 2), (16, 64, 128, 4),
        (16, 128, 128, 4), (8, 64, 128, 4), (8, 128, 128, 4), (8, 32, 256, 2), (8, 32, 512, 2),
        (8, 64, 256, 4), (16, 64, 256, 4), (32, 64, 128, 4), (64, 64, 128, 4), (32, 128, 128, 8),
        (64, 128, 128, 8)]
        for split in (1, 2, 4, 8)],
    ("dequant_dot", 16, 32, 128, 4, 4), ("dequant_dot", 16, 64, 128, 4, 4),
    ("dequant_dot", 16, 128, 128, 8, 3),
]]  # fmt: skip
ROW_KERNEL_MAX_TIMED = 8
# The dequantize pass past 64 rows by slices of this many MB of bf16 weight (0: whole), beside
# the engine's own (DEQUANTIZE_SLICE_BYTES).
SLICE_MB = [0, 4, 8, 16, 32]
# The dot kernel past 64 rows (prefill chunks, large decode batches), against what the engine
# runs there: (block_m, block_n, block_k, num_warps, num_stages).
LARGE_M_CANDIDATES = [Int4Tiles("dot", *c, split_k=split) for c in [
    (64, 128, 128, 8, 3), (64, 256, 128, 8, 3), (128, 128, 128, 8, 3), (64, 64, 256, 4, 4),
    (128, 64, 128, 4, 3), (64, 128, 128, 4, 3),
] for split in (1, 2, 4)]  # fmt: skip

# The Gluon kernel past 64 rows: (block_m, num_warps, stages, split_k), block_n 16 a warp; an
# x tile at most M rounded up to a power of two, and at least a quarter of it (to 256).
GLUON_CANDIDATES = [
    (bm, warps, stages, split)
    for bm in (64, 128, 256) for warps in (4, 8) for stages in (3, 4) for split in (1, 2, 4, 8)
]  # fmt: skip


def gluon_configs(m: int, n: int, k: int, default_only: bool) -> list[tuple[str, Any, Any]]:
    """The Gluon kernel's configs at M rows of an [N, K] layer: its defaults, and unless
    default_only GLUON_CANDIDATES' that fit M and K's steps; none off Hopper."""
    x = torch.empty(0, k, device=DEVICE, dtype=torch.bfloat16)
    qweight = torch.empty(n, k // 8, device=DEVICE, dtype=torch.int32)
    if not gluon_int4.applies(x, qweight, x, GROUP, None):  # bf16 scales
        print(f"  M={m}: no Gluon kernel here (kernels/gluon_int4.py: Hopper, Gluon)")
        return []
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    tiles = [gluon_int4.default_tiles(m, n, k, sms)]
    if not default_only:
        top = max(64, triton.next_power_of_2(min(m, 256)))
        tiles += [
            gluon_int4.WgmmaTiles(bm, 16 * warps, warps, stages, split)
            for bm, warps, stages, split in GLUON_CANDIDATES
            if top // 4 <= bm <= top and (k // gluon_int4.BLOCK_K) % split == 0
        ]
    names = ["gluon default"] + [gluon_label(t) for t in tiles[1:]]
    return [
        (name, functools.partial(_gluon, tiles=t), t) for name, t in zip(names, tiles, strict=True)
    ]


def gluon_label(t: gluon_int4.WgmmaTiles) -> str:
    return f"gluon m{t.block_m} n{t.block_n} w{t.num_warps} s{t.stages} split{t.split_k}"


def tiles_for(tiles: Int4Tiles, m: int) -> Int4Tiles | None:
    """The candidate at M rows, or None where it does not apply."""
    if tiles.kind == "rows":
        return tiles if m <= ROW_KERNEL_MAX_TIMED else None
    if tiles.kind == "dot" and tiles.block_m > max(8, triton.next_power_of_2(m)):
        return None  # x tiles past M rounded up to a power of two (at least 8): idle MMAs
    return None if m > 64 else tiles


def label(tiles: Int4Tiles) -> str:
    return (
        f"{tiles.kind} m{tiles.block_m} n{tiles.block_n} k{tiles.block_k} "
        f"w{tiles.num_warps} s{tiles.num_stages} split{tiles.split_k}"
    )


def make_layers(shape: Shape, copies: int) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator(device=DEVICE).manual_seed(shape.n)
    layers = []
    for _ in range(copies):
        weight = torch.randn(shape.n, shape.k, generator=gen, device=DEVICE) * shape.k**-0.5
        qweight, scales, zeros = quantize_int4_reference(weight, GROUP, symmetric=False)
        layers.append((qweight, scales.to(torch.bfloat16), zeros))
    return layers


def sweep_shape(
    shape: Shape, ms: list[int], copies: int, default_only: bool = False, gluon_only: bool = False
) -> list[dict[str, Any]]:
    layers = make_layers(shape, copies)
    peer_layers = [tinygemm_layer(*layer) for layer in layers]
    packed_bytes = sum(t.numel() * t.element_size() for t in layers[0] if t is not None)
    rows = []
    for m in ms:
        x = torch.randn(m, shape.k, device=DEVICE).to(torch.bfloat16)
        rows.append(quantized_sweep.bf16_row(shape, m, x, copies))
        if m > 64:  # the engine's (int4_linear's own choice), the dot and Gluon kernels'
            configs = [("engine", functools.partial(_int4, tiles=None), None)]
            configs += gluon_configs(m, shape.n, shape.k, default_only)
            if not (default_only or gluon_only):
                configs += [
                    (f"dequantize by {mb} MB slices", functools.partial(_sliced, mb=mb), None)
                    for mb in SLICE_MB
                ]
                configs += [
                    *[(label(t), functools.partial(_int4, tiles=t), t) for t in LARGE_M_CANDIDATES],
                ]
        else:
            tiles = [default_tiles(m, shape.n, shape.k)]
            if not default_only:
                tiles += [t for c in CANDIDATES if (t := tiles_for(c, m)) is not None]
            configs = [(label(t), functools.partial(_int4, tiles=t), t) for t in tiles]
        expected = int4_linear_reference(x, *layers[0], GROUP)
        rows += quantized_sweep.time_configs(shape, x, layers, expected, configs, packed_bytes)
        peer = [("torch tinygemm (peer)", _tinygemm, None)]
        rows += quantized_sweep.time_configs(shape, x, peer_layers, expected, peer, packed_bytes)
        quantized_sweep.print_best(shape, m, rows)
    return rows


def tinygemm_layer(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer in tinygemm's layout: two values a byte (the even column high), then its
    tiling (8 inner K tiles); a scale and a float zero per group, w = (q - 8) scale + zero."""
    q = unpack_weight(qweight)  # [N, K] in 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]), 8)
    scale = scales.float()
    zero = (8.0 - zeros.float()) * scale  # (q - z) s = (q - 8) s + (8 - z) s
    return packed, torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous().bfloat16()


def _tinygemm(x: torch.Tensor, layer: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch._weight_int4pack_mm(x, layer[0], GROUP, layer[1])


def _sliced(x: torch.Tensor, layer: tuple[torch.Tensor, ...], mb: int) -> torch.Tensor:
    """The dequantize pass and cuBLAS by slices of `mb` MB of the weight (0: whole)."""
    engine_bytes = triton_int4_dequant.DEQUANTIZE_SLICE_BYTES
    triton_int4_dequant.DEQUANTIZE_SLICE_BYTES = mb << 20
    try:
        return _int4(x, layer, tiles=None)
    finally:
        triton_int4_dequant.DEQUANTIZE_SLICE_BYTES = engine_bytes


def _gluon(
    x: torch.Tensor, layer: tuple[torch.Tensor, ...], tiles: gluon_int4.WgmmaTiles
) -> torch.Tensor:
    qweight, scales, zeros = layer
    return gluon_int4.gluon_int4_linear(x, qweight, scales, zeros, GROUP, tiles=tiles)


def _int4(
    x: torch.Tensor, layer: tuple[torch.Tensor, ...], tiles: Int4Tiles | None
) -> torch.Tensor:
    qweight, scales, zeros = layer
    return int4_linear(x, qweight, scales, zeros, GROUP, tiles=tiles)


def sweep_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--default-only", action="store_true")
    parser.add_argument(
        "--gluon-only", action="store_true",
        help="past 64 rows, the engine's choice and the Gluon tiles alone",
    )  # fmt: skip


if __name__ == "__main__":
    args = quantized_sweep.parse_args(__doc__.split("\n\n")[0], [1, 16, 32, 64, 256], sweep_flags)
    sweep = functools.partial(
        sweep_shape, default_only=args.default_only, gluon_only=args.gluon_only
    )
    quantized_sweep.run(args, sweep, with_lm_head=False)
