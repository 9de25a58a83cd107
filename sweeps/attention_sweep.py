"""Split-KV decode attention: launch configs against the defaults, with bf16 and FP8 caches.

For each KV cache dtype (bf16, e4m3) and each (batch, context) of CASES at Llama-3.1-8B's
attention shape (32 query heads, 8 KV heads, head_dim 128, block_size 16), times
`paged_decode_attention` with `default_decode_tiles` and with every `DecodeTiles` of CANDIDATES
at the split count the kernel picks for that tile; then the fastest candidate and the defaults
again at SPLIT_FACTORS times their split count. Reports microseconds per call and the fraction
of copy bandwidth (bytes and timing: benchmarks/kernel_bench.py; an FP8 cache counts its own,
half, bytes). Every config is first checked against the defaults' output and skipped, with the
error, if it fails, does not compile or runs out of shared memory. Kernels are compiled in
parallel processes first (one kernel per tile config). `--split-counts` times only the defaults'
tiles, at their picked split count and at each count given (how `pick_num_splits` should count).

    python -m sweeps.attention_sweep --out $OUT/attention_sweep.json
    python -m sweeps.attention_sweep --split-counts 1 2 3 4 8 --cases 64x32768 32x4096

Needs a CUDA GPU and ~10 GB of its memory; about 2-3 minutes on an H100.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import torch
import triton

from benchmarks.kernel_bench import copy_bandwidth_gbs, decode_case, median_ms
from kernels.triton_decode_attention import (
    DecodeTiles,
    default_decode_tiles,
    most_splits,
    paged_decode_attention,
    pick_num_splits,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3.1-8B; kernel_bench's
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
CASES = [(64, 32768), (256, 4096), (1, 4096), (32, 4096)]  # (batch, context)
# tile x warps x stages; with FP8 a tile holds half the bytes, so larger tiles may pay. A tile
# whose K/V stages do not fit shared memory fails to compile and is reported as skipped.
CANDIDATES = [
    DecodeTiles(tile, warps, stages)
    for tile in (64, 128, 256)
    for warps in (4, 8)
    for stages in (2, 3, 4)
]
SPLIT_FACTORS = (0.5, 2, 4)  # of the picked split count, for the best candidate and the defaults
ATOL_OF_MAX = 2e-2  # tolerance against the defaults' output, relative to its largest value


@dataclasses.dataclass(frozen=True)
class Config:
    tiles: DecodeTiles
    num_splits: int

    def label(self) -> str:
        t = self.tiles
        return f"tile{t.tile} w{t.num_warps} s{t.num_stages} splits{self.num_splits}"

    def asdict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self.tiles), "num_splits": self.num_splits}


# --- Configs ------------------------------------------------------------------------------------


def picked_splits(batch: int, context: int, tiles: DecodeTiles) -> int:
    """The split count `paged_decode_attention` picks for this case (num_splits=None)."""
    max_blocks = triton.cdiv(context, BLOCK_SIZE)
    device = torch.device("cuda")
    return pick_num_splits(batch, NUM_KV_HEADS, max_blocks, BLOCK_SIZE, device, tiles.tile)


def default_config(kv_dtype: torch.dtype, batch: int, context: int) -> Config:
    tiles = default_decode_tiles(kv_dtype, BLOCK_SIZE)
    return Config(tiles, picked_splits(batch, context, tiles))


def first_configs(kv_dtype: torch.dtype, batch: int, context: int) -> list[Config]:
    """The defaults, then every candidate at its picked split count."""
    default = default_config(kv_dtype, batch, context)
    others = [Config(t, picked_splits(batch, context, t)) for t in CANDIDATES]
    return [default, *(c for c in others if c != default)]


def given_splits(
    kv_dtype: torch.dtype, batch: int, context: int, counts: list[int]
) -> list[Config]:
    """The defaults, then their tiles at each of `counts` the kernel would make."""
    default = default_config(kv_dtype, batch, context)
    most = most_splits(triton.cdiv(context, BLOCK_SIZE), BLOCK_SIZE, default.tiles.tile)
    others = [Config(default.tiles, n) for n in counts if n <= most]
    return [default, *(c for c in dict.fromkeys(others) if c != default)]


def split_variants(config: Config, context: int) -> list[Config]:
    """config at SPLIT_FACTORS times its split count, within what the kernel would make."""
    most = most_splits(triton.cdiv(context, BLOCK_SIZE), BLOCK_SIZE, config.tiles.tile)
    counts = {max(1, min(most, int(config.num_splits * f))) for f in SPLIT_FACTORS}
    return [Config(config.tiles, n) for n in sorted(counts - {config.num_splits})]


# --- Timing -------------------------------------------------------------------------------------


def measure_cell(
    kv_name: str, batch: int, context: int, configs: list[Config], copy_gbs: float, stage: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows, skipped) of configs on one case; each checked against the defaults' output."""
    kv_dtype = KV_DTYPES[kv_name]
    torch.cuda.empty_cache()  # the last case's cache, freed on its return
    torch.manual_seed(batch * 1_000_003 + context)  # the same inputs in both stages
    inputs, num_bytes = decode_case(batch, context, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, kv_dtype)
    scale = HEAD_DIM**-0.5
    default = default_config(kv_dtype, batch, context)

    def call(config: Config) -> Any:
        # The defaults as the engine runs them (no count given: the picked one, each request
        # sizing its splits); any other config with its count given (even shares).
        splits = None if config == default else config.num_splits
        return functools.partial(paged_decode_attention, *inputs, scale, splits, tiles=config.tiles)

    expected = call(default)().float()
    atol = ATOL_OF_MAX * expected.abs().amax().item()
    cell = {"kv_dtype": kv_name, "batch": batch, "context": context}
    rows, skipped = [], []
    for config in configs:
        try:
            out = call(config)().float()
            torch.testing.assert_close(out, expected, atol=atol, rtol=2e-2)
            ms = median_ms(call(config))
        except Exception as error:  # a config that fails to compile, run or match is skipped
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            reason = "; ".join(lines[:3] or [type(error).__name__])[:200]
            skipped.append({**cell, "config": config.asdict(), "error": reason})
            print(f"  skipped {config.label()}: {reason}", flush=True)
            continue
        gb_per_s = num_bytes / (ms * 1e-3) / 1e9
        rows.append(
            {
                **cell,
                "config": config.asdict(),
                "label": config.label(),
                "is_default": config == default,
                "stage": stage,
                "us": round(1000 * ms, 2),
                "gb_per_s": round(gb_per_s, 1),
                "fraction_of_copy": round(gb_per_s / copy_gbs, 3),
            }
        )
    return rows, skipped


# --- Parallel compiles --------------------------------------------------------------------------


def _compile(job: tuple[str, Config]) -> None:
    """Runs one config on a small case specialised as the real ones are (the same head shape and
    block size; strides and table width divisible by 16): Triton caches it."""
    kv_name, config = job
    blocks = 64  # >= MAX_SPLITS, so the split count is not clamped
    query = torch.randn(1, NUM_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    shape = (blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cache = torch.randn(shape, device="cuda").to(KV_DTYPES[kv_name])
    tables = torch.arange(blocks, device="cuda", dtype=torch.int32).view(1, blocks)
    seq_lens = torch.full((1,), blocks * BLOCK_SIZE, device="cuda", dtype=torch.int32)
    with contextlib.suppress(Exception):  # the sweep reports it
        paged_decode_attention(
            query, cache, cache, tables, seq_lens, 0.1, config.num_splits, tiles=config.tiles
        )
        torch.cuda.synchronize()


def precompile(jobs: list[tuple[str, Config]], processes: int) -> None:
    """Compiles every (kv dtype, config) in `processes` processes at once."""
    jobs = list(dict.fromkeys(jobs))
    if processes <= 0 or not jobs:
        return
    started = time.perf_counter()
    try:
        with multiprocessing.get_context("spawn").Pool(min(processes, len(jobs))) as pool:
            pool.map(_compile, jobs, chunksize=1)
    except Exception as error:  # compiles then happen in the sweep, only slower
        print(f"[compile] parallel compile failed ({error}); compiling serially", flush=True)
        return
    print(f"[compile] {len(jobs)} kernels in {time.perf_counter() - started:.1f} s", flush=True)


# --- Report -------------------------------------------------------------------------------------


def best_rows(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(defaults, fastest) per case, in sweep order."""
    cells: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault((row["kv_dtype"], row["batch"], row["context"]), []).append(row)
    pairs = []
    for cell_rows in cells.values():
        default = next((r for r in cell_rows if r["is_default"]), None)
        if default is not None:
            pairs.append((default, min(cell_rows, key=lambda r: r["us"])))
    return pairs


def print_table(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    print(f"{'kv':<5}{'batch':>6}{'context':>8}{'default us':>12}{'frac':>6}"
          f"{'best us':>10}{'frac':>6}{'speedup':>9}  best config")  # fmt: skip
    for default, best in pairs:
        print(f"{default['kv_dtype']:<5}{default['batch']:>6}{default['context']:>8}"
              f"{default['us']:>12.1f}{default['fraction_of_copy']:>6.2f}"
              f"{best['us']:>10.1f}{best['fraction_of_copy']:>6.2f}"
              f"{default['us'] / best['us']:>8.2f}x  {best['label']}")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("attention_sweep.json"), help="JSON path")
    parser.add_argument(
        "--kv-dtypes", nargs="+", choices=sorted(KV_DTYPES), default=["bf16", "fp8"]
    )
    parser.add_argument("--jobs", type=int, default=12, help="compile processes; 0: in the sweep")
    parser.add_argument(
        "--split-counts",
        nargs="+",
        type=int,
        help="time only the default tiles, at these split counts (one stage)",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        type=parse_case,
        default=CASES,
        help="BATCHxCONTEXT cases (default: %(default)s)",
    )
    return parser.parse_args(argv)


def parse_case(text: str) -> tuple[int, int]:
    batch, _, context = text.partition("x")
    return int(batch), int(context)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_sweep.py times kernels on a CUDA GPU, and none is visible")
    started = time.perf_counter()
    print(f"[device] {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)  # fmt: skip
    cells = [(kv, batch, context) for kv in args.kv_dtypes for batch, context in args.cases]
    if args.split_counts:
        first = {c: given_splits(KV_DTYPES[c[0]], *c[1:], args.split_counts) for c in cells}
    else:
        first = {cell: first_configs(KV_DTYPES[cell[0]], *cell[1:]) for cell in cells}
    precompile([(cell[0], c) for cell, configs in first.items() for c in configs], args.jobs)
    copy_gbs = copy_bandwidth_gbs()
    print(f"[copy] {copy_gbs:.0f} GB/s", flush=True)

    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    second: dict[tuple[str, int, int], list[Config]] = {}
    for cell in cells:
        tick = time.perf_counter()
        cell_rows, cell_skips = measure_cell(*cell, first[cell], copy_gbs, stage=1)
        rows, skipped = rows + cell_rows, skipped + cell_skips
        if cell_rows and not args.split_counts:  # split counts around the fastest, the defaults
            best = min(cell_rows, key=lambda r: r["us"])["label"]
            by_label = {c.label(): c for c in first[cell]}
            around = dict.fromkeys([first[cell][0], by_label[best]])  # the defaults, the best
            second[cell] = [v for c in around for v in split_variants(c, cell[2])]
        print(f"[{cell[0]} {cell[1]}x{cell[2]}] {len(cell_rows)} timed, {len(cell_skips)} "
              f"skipped, {time.perf_counter() - tick:.1f} s", flush=True)  # fmt: skip

    precompile([(cell[0], c) for cell, configs in second.items() for c in configs], args.jobs)
    for cell, configs in second.items():
        tick = time.perf_counter()
        cell_rows, cell_skips = measure_cell(*cell, configs, copy_gbs, stage=2)
        rows, skipped = rows + cell_rows, skipped + cell_skips
        print(f"[{cell[0]} {cell[1]}x{cell[2]} splits] {len(cell_rows)} timed, "
              f"{time.perf_counter() - tick:.1f} s", flush=True)  # fmt: skip

    pairs = best_rows(rows)
    report = {
        "benchmark": "attention_sweep",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gb_per_s": round(copy_gbs, 1),
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "query_dtype": "bfloat16",
        },
        "rows": rows,
        "skipped": skipped,
        "best": [best for _, best in pairs],
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"[done] {report['elapsed_s']:.0f} s, wrote {args.out}")
    print_table(pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
