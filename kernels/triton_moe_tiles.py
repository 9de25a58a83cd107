"""The MoE kernels' tiles (kernels/triton_moe.py), chosen by sweeps on an H200 at
Qwen3-30B-A3B's layer shape (128 experts, top 8, hidden 2048, experts' width 768):
sweeps/moe_gemv_sweep.py for the GEMV kernels, sweeps/moe_grouped_sweep.py for the grouped
GEMMs by the number of (token, expert) pairs.

group_m 8 (programs take 8 blocks of pairs at a time, each block's column tiles in turn) was
within 2 % of the best of 1 to 32 at 256 to 16,384 tokens, bf16 and FP8 (H100, 2026-12-06,
`--groups-only`). Every block of a column tile first, the order before, took about 11 % (FP8)
and 19 % (bf16) longer a layer at 16,384 tokens, and the same at 256. swap_ab helped only the
FP8 gate/up GEMM at 16,384 tokens, and only with that row's tiles."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GemvTiles:
    """The GEMV kernels' tiles: output columns and K a program step (powers of two), warps."""

    gate_up_n: int = 16
    gate_up_k: int = 256
    down_n: int = 4
    down_k: int = 512
    num_warps: int = 4


DEFAULT_GEMV_TILES = GemvTiles()
# FP8 experts (a scale a row or a row and group), whose loads move half the bytes of bf16's:
# the down GEMV takes a K step of 1,024 (the expert's 768 columns in one step). A layer's
# routing and experts at one token took 35.5 us against 44.0 with bf16's tiles, 58.7 against
# 75.6 at two (H100, 2026-12-07, `python3 -m sweeps.moe_gemv_sweep --fp8`; the best of 84
# tiles was 35.0 at one token).
FP8_GEMV_TILES = GemvTiles(down_k=1024)


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """One grouped GEMM's tiles: output columns and K a program step, warps, pipeline stages,
    how many blocks of pairs the programs take at a time (kernels/triton_moe.block_tile), and
    whether each step multiplies the transposes, weights first (kernels/triton_moe.tile_product).
    """

    n: int = 64
    k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    swap_ab: bool = False


@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """Both grouped GEMMs' tiles; block_m pairs a program (each expert's group is padded to
    it, so both kernels share it)."""

    block_m: int
    gate_up: GemmTiles = GemmTiles()
    down: GemmTiles = GemmTiles()


# (at most this many pairs, their tiles), in increasing order; the last takes any count. Swept
# at 16, 64, 256, 1,024, 4,096 and 16,384 tokens (x 8 pairs); 4-24 % faster than 64 x 64 tiles
# of block 16 (up to 1,024 pairs) or 64 (past them).
GROUPED_TILES: tuple[tuple[int, GroupedTiles], ...] = (
    (256, GroupedTiles(16, GemmTiles(64, 128, 4, 4), GemmTiles(64, 128, 4, 2))),
    (1024, GroupedTiles(16, GemmTiles(128, 128, 4, 3), GemmTiles(128, 128, 4, 2))),
    (4096, GroupedTiles(32, GemmTiles(64, 128, 4, 2), GemmTiles(64, 128, 4, 3))),
    (16384, GroupedTiles(64, GemmTiles(64, 64, 4, 3), GemmTiles(128, 64, 4, 3))),
    (1 << 62, GroupedTiles(128, GemmTiles(128, 64, 8, 3), GemmTiles(128, 64, 8, 3))),
)


# FP8 experts (W8A8, a scale a row): sweeps/moe_grouped_sweep.py --fp8 at 64, 256, 1,024, 4,096
# and 16,384 tokens (H200, 2026-12-04): 5-24 % faster than bf16's tiles on FP8 experts, whose
# tiles take half the shared memory (wider K steps, more stages); up to 256 pairs, not swept.
GROUPED_TILES_FP8: tuple[tuple[int, GroupedTiles], ...] = (
    GROUPED_TILES[0],
    (1024, GroupedTiles(16, GemmTiles(64, 256, 4, 4), GemmTiles(64, 256, 4, 3))),
    (4096, GroupedTiles(16, GemmTiles(64, 256, 4, 4), GemmTiles(64, 128, 4, 4))),
    (16384, GroupedTiles(64, GemmTiles(64, 128, 8, 3), GemmTiles(128, 128, 8, 4))),
    (65536, GroupedTiles(64, GemmTiles(64, 128, 4, 4), GemmTiles(128, 128, 8, 4))),
    # 16,384 tokens, H100, 2026-12-06, with the programs' order and the transposed products
    # swept too: 2,317 us a layer against 2,551 with the row above's tiles
    (
        1 << 62,
        GroupedTiles(
            128, GemmTiles(64, 128, 4, 3, group_m=2, swap_ab=True), GemmTiles(128, 256, 8, 3)
        ),
    ),
)


def grouped_tiles(num_pairs: int, fp8: bool = False) -> GroupedTiles:
    table = GROUPED_TILES_FP8 if fp8 else GROUPED_TILES
    return next(tiles for most, tiles in table if num_pairs <= most)
