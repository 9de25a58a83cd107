"""Skinny (decode) linear layers at 8B shapes: Triton tile configs against cuBLAS.

For each shape (qkv, o, gate_up, down, lm_head) of --model (Llama-3.1-8B, Qwen3-8B, ...; for
Qwen3-30B-A3B, `qwen3-moe`, its dense layers and router) and each M
in --m, times torch's F.linear (cuBLAS) and every config in CANDIDATES of `kernels.triton_linear`,
and reports microseconds per call and GB/s of weights read. Then times one decode step's worth of
linear layers, layers x (qkv, o, gate_up, down) + lm_head, with torch, with `default_tiles` (the
picks of the last run) and with the best Triton config per shape.

Not an L2 measurement: each shape has one weight copy per layer (32 or 36, as the model has; 2
for lm_head, 1 GB each), 15-16 GB in all against the H100's 50 MB L2, and a timed CUDA graph
calls the layer on every copy in turn, so each weight comes from HBM. The graph also takes Python
launch overhead out (a Triton launch costs more host time than an o projection takes on the GPU).
Every config is first checked against F.linear (relative error < 2e-2) and skipped, with the
reason, if it fails or does not compile. Kernels are compiled in parallel processes first, to
fill Triton's disk cache (about 1 s of compile each, ~20 kernels).

    python -m sweeps.linear_sweep --out $OUT/linear_sweep.json
    python -m sweeps.linear_sweep --model qwen3 --m 1 16 32 64 --step-m 32 64

Needs a CUDA GPU and ~17 GB of its memory; a minute or two on an H100.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

from kernels.triton_linear import (
    MAX_ROWS,
    LinearTiles,
    default_tiles,
    skinny_linear,
)
from kernels.triton_stages import exact_stages

DEVICE = "cuda"
# H100 copy bandwidth, measured 3.02 TB/s
# (docs/results/2026-11-23-h100-kernels-graphs-vs-transformers/floors.json)
FLOOR_BYTES_PER_S = 3.0e12
MAX_REL_ERR = 2e-2
TIMED_S = 0.05  # replays per measurement: about this long, 5 to 30 of them
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, weight) -> out


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    n: int  # output features (weight rows)
    k: int  # input features


MODEL_LAYERS = {
    "llama": 32, "llama-tp2": 32, "qwen3": 36, "smollm2": 30, "qwen3-0.6b": 28, "gemma3-12b": 48,
    "qwen3-moe": 48, "qwen3-eagle3": 2,
}  # fmt: skip
MODEL_SHAPES = {  # one decode step: MODEL_LAYERS of each but lm_head
    "llama": [  # Llama-3.1-8B, 32 layers
        Shape("qkv", 6144, 4096),
        Shape("o", 4096, 4096),
        Shape("gate_up", 28672, 4096),
        Shape("down", 4096, 14336),
        Shape("lm_head", 128256, 4096),
    ],
    "llama-tp2": [  # one rank's part of Llama-3.1-8B at --tensor-parallel-size 2
        Shape("qkv", 3072, 4096),
        Shape("o", 4096, 2048),
        Shape("gate_up", 14336, 4096),
        Shape("down", 4096, 7168),
        Shape("lm_head", 64128, 4096),
    ],
    "qwen3": [  # Qwen3-8B, 36 layers
        Shape("qkv", 6144, 4096),
        Shape("o", 4096, 4096),
        Shape("gate_up", 24576, 4096),
        Shape("down", 4096, 12288),
        Shape("lm_head", 151936, 4096),
    ],
    "smollm2": [  # SmolLM2-135M, 30 layers: every layer latency-bound, not bandwidth-bound
        Shape("qkv", 960, 576),
        Shape("o", 576, 576),
        Shape("gate_up", 3072, 576),
        Shape("down", 576, 1536),
        Shape("lm_head", 49152, 576),
    ],
    "qwen3-0.6b": [  # Qwen3-0.6B, 28 layers: hidden 1024, its o and down reading longer K
        Shape("qkv", 4096, 1024),
        Shape("o", 1024, 2048),
        Shape("gate_up", 6144, 1024),
        Shape("down", 1024, 3072),
        Shape("lm_head", 151936, 1024),
    ],
    "qwen3-moe": [  # Qwen3-30B-A3B's dense layers, 48 (the experts: kvflow bench moe): hidden
        # 2048, so every layer is a few microseconds; the router's 128 rows
        Shape("qkv", 5120, 2048),
        Shape("o", 2048, 4096),
        Shape("router", 128, 2048),
        Shape("lm_head", 151936, 2048),
    ],
    "qwen3-eagle3": [  # the Qwen3-8B EAGLE-3 head (shared/presets/Qwen3-8B-EAGLE3.json): at
        # batch 1 and k = 2 a step runs fc once and its layer at 3 rows (the verified ones),
        # then the layer again, the lm_head twice, at 1 row (`--m 1 3`; the sweep's step, every
        # shape but lm_head twice, only approximates that); qkv reads twice the hidden size
        Shape("fc", 4096, 12288),
        Shape("qkv", 6144, 8192),
        Shape("o", 4096, 4096),
        Shape("gate_up", 24576, 4096),
        Shape("down", 4096, 12288),
        Shape("lm_head", 32000, 4096),
    ],
    "gemma3-12b": [  # Gemma-3-12B, 48 layers: K 3840 is no power of two; a vocabulary of 262k
        Shape("qkv", 8192, 3840),
        Shape("o", 3840, 4096),
        Shape("gate_up", 30720, 3840),
        Shape("down", 3840, 15360),
        Shape("lm_head", 262208, 3840),
    ],
}
# (block_n, block_k, num_warps, num_stages): BLOCK_N 16/32/64 x BLOCK_K 128..512, tl.dot; and
# the multiply-add variant, whose accumulator caps it at M <= 4 (M = 1 for the widest).
# A config whose tiles do not fit shared memory at some M fails to compile there and is skipped.
CANDIDATES = [LinearTiles(*c) for c in [
    (16, 128, 4, 5), (16, 256, 4, 4), (16, 512, 4, 3), (16, 512, 8, 4),
    (32, 128, 4, 5), (32, 256, 4, 4), (32, 256, 8, 5), (32, 512, 4, 4), (32, 512, 8, 3),
    (64, 128, 4, 4), (64, 256, 4, 5), (64, 256, 8, 3),
    # for 32 and 64 rows, whose x tiles take shared memory too
    (32, 64, 4, 8), (64, 64, 4, 6), (64, 128, 8, 4), (128, 64, 8, 4), (128, 128, 8, 3),
    # small models (hidden < 1024): more, shorter programs
    (16, 64, 4, 4), (16, 64, 2, 4), (16, 128, 2, 4), (16, 128, 4, 3), (16, 256, 2, 3),
    (32, 64, 2, 4), (32, 128, 2, 3),
]] + [LinearTiles(*c, use_dot=False) for c in [
    (8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 8, 3), (32, 256, 4, 3),
    # M = 1 at a rank's halved shapes (fewer weight rows or a shorter K per program)
    (4, 512, 4, 3), (8, 256, 4, 4), (8, 512, 4, 4), (4, 1024, 4, 2), (8, 256, 2, 4),
    # M = 1 with PDL: longer K steps, fewer rows, more stages in flight
    (2, 1024, 4, 2), (2, 2048, 4, 2), (4, 1024, 4, 3), (4, 2048, 8, 2), (8, 1024, 4, 2),
    (4, 512, 2, 4),
    # an MoE router's few rows (N 128) at 2-16 rows
    (2, 512, 4, 2),
]]  # fmt: skip


def label(tiles: LinearTiles | None) -> str:
    if tiles is None:
        return "torch"
    kind = "dot" if tiles.use_dot else "fma"
    return f"{kind} n{tiles.block_n} k{tiles.block_k} w{tiles.num_warps} s{tiles.num_stages}"


def linear_fn(tiles: LinearTiles | None) -> Linear:
    """The layer as (x, weight) -> out: torch (tiles None) or skinny_linear with `tiles`."""
    return F.linear if tiles is None else functools.partial(skinny_linear, tiles=tiles)


# --- Timing -------------------------------------------------------------------------------------


def capture(run: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `run`, after one warm-up call on a side stream (cuBLAS workspaces)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph) -> float:
    """Median seconds per replay, each bracketed by CUDA events."""
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    reps = min(30, max(5, int(TIMED_S / (start.elapsed_time(end) * 1e-3))))
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1e-3


def time_layer(fn: Linear, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Seconds per call of `fn`, calling it once on each weight copy per replay."""
    graph = capture(lambda: [fn(x, w) for w in weights])
    seconds = time_graph(graph) / len(weights)
    del graph
    return seconds


# --- Inputs -------------------------------------------------------------------------------------


def make_weights(
    shapes: list[Shape], layers: int, dtype: torch.dtype, seed: int
) -> dict[str, list[torch.Tensor]]:
    """One [N, K] weight per layer and shape (2 for lm_head), normal(0, 1 / K)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    weights: dict[str, list[torch.Tensor]] = {}
    for shape in shapes:
        copies = 2 if shape.name == "lm_head" else layers
        weights[shape.name] = [random_weight(shape, dtype, gen) for _ in range(copies)]
    return weights


def random_weight(shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    weight = torch.randn(shape.n, shape.k, generator=gen, device=DEVICE)  # [N, K] float32
    return weight.mul_(shape.k**-0.5).to(dtype)


def make_input(shape: Shape, m: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(m, shape.k, generator=gen, device=DEVICE).to(dtype)  # [M, K]


def rel_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).norm() / expected.float().norm()).item()


# --- The sweep ----------------------------------------------------------------------------------


def measure(
    shape: Shape, m: int, tiles: LinearTiles | None, x: torch.Tensor, weights: list[torch.Tensor]
) -> dict[str, Any]:
    """One result row; raises when the config fails the check against torch."""
    fn = linear_fn(tiles)
    error = rel_error(fn(x, weights[0]), F.linear(x, weights[0]))
    if not error < MAX_REL_ERR:  # NaN fails too
        raise ValueError(f"relative error {error:.2e} >= {MAX_REL_ERR}")
    seconds = time_layer(fn, x, weights)
    weight_bytes = weights[0].numel() * weights[0].element_size()
    return {
        "shape": shape.name,
        "m": m,
        "impl": label(tiles),
        "tiles": dataclasses.asdict(tiles) if tiles is not None else None,
        "us": seconds * 1e6,
        "gb_per_s": weight_bytes / seconds / 1e9,
        "rel_err": error,
    }


def sweep_impl(
    tiles: LinearTiles | None,
    shapes: list[Shape],
    inputs: dict[tuple[str, int], torch.Tensor],
    weights: dict[str, list[torch.Tensor]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(results, skipped) of one implementation over every shape and M."""
    by_name = {shape.name: shape for shape in shapes}
    results, skipped = [], []
    for (name, m), x in inputs.items():
        shape = by_name[name]
        try:
            results.append(measure(shape, m, tiles, x, weights[name]))
        except Exception as error:  # a config that fails to compile or to match is skipped
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            skipped.append({"impl": label(tiles), "shape": name, "m": m, "reason": reason})
    return results, skipped


def report_skips(skipped: list[dict[str, Any]]) -> None:
    """One line per (config, reason), naming the shapes and M it covers."""
    by_reason: dict[tuple[str, str], list[str]] = {}
    for s in skipped:
        by_reason.setdefault((s["impl"], s["reason"]), []).append(f"{s['shape']}@{s['m']}")
    for (impl, reason), cases in by_reason.items():
        print(f"  skipped {impl} on {' '.join(cases)}: {reason}", flush=True)


def best_results(results: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """The fastest Triton row per (shape, M)."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for row in results:
        key = (row["shape"], row["m"])
        if row["tiles"] is not None and (key not in best or row["us"] < best[key]["us"]):
            best[key] = row
    return best


# --- One decode step's worth of linear layers ---------------------------------------------------


def step_variants(
    best: dict[tuple[str, int], dict[str, Any]], shapes: list[Shape], m: int, dtype: torch.dtype
) -> dict[str, dict[str, Linear]]:
    """Layer functions of a step: torch, Triton's `default_tiles` and its best per shape (if
    every shape has one)."""
    variants = {
        "torch": {shape.name: linear_fn(None) for shape in shapes},
        "triton_default": {s.name: linear_fn(default_tiles(m, s.n, s.k, dtype)) for s in shapes},
    }
    rows = {shape.name: best.get((shape.name, m)) for shape in shapes}
    if any(row is None for row in rows.values()):
        return variants  # a shape with no working config: no Triton step
    triton_fns = {name: linear_fn(LinearTiles(**row["tiles"])) for name, row in rows.items() if row}
    return {**variants, "triton": triton_fns}


def decode_step(
    fns: dict[str, Linear],
    weights: dict[str, list[torch.Tensor]],
    inputs: dict[str, torch.Tensor],  # shape name -> x [M, K]
    layers: int,
) -> Callable[[], None]:
    per_layer = [name for name in weights if name != "lm_head"]  # the model's shapes

    def run() -> None:
        for layer in range(layers):
            for name in per_layer:
                fns[name](inputs[name], weights[name][layer])
        fns["lm_head"](inputs["lm_head"], weights["lm_head"][0])

    return run


def time_steps(
    best: dict[tuple[str, int], dict[str, Any]],
    shapes: list[Shape],
    weights: dict[str, list[torch.Tensor]],
    m: int,
    layers: int,
) -> list[dict[str, Any]]:
    dtype = weights["qkv"][0].dtype
    inputs = {shape.name: make_input(shape, m, dtype, seed=m) for shape in shapes}
    per_layer = sum(weights[s.name][0].nbytes for s in shapes if s.name != "lm_head")
    step_bytes = layers * per_layer + weights["lm_head"][0].nbytes
    rows = []
    for variant, fns in step_variants(best, shapes, m, dtype).items():
        try:  # a default pick that does not compile here (shared memory): reported, not timed
            graph = capture(decode_step(fns, weights, inputs, layers))
        except (triton.CompilationError, triton.OutOfResources) as exc:
            print(f"step M={m} {variant}: skipped, {type(exc).__name__}: {exc}", flush=True)
            continue
        seconds = time_graph(graph)
        del graph
        rows.append(
            {
                "m": m,
                "variant": variant,
                "ms": seconds * 1e3,
                "gb_per_s": step_bytes / seconds / 1e9,
                "floor_ms": step_bytes / FLOOR_BYTES_PER_S * 1e3,
                "weight_gb": step_bytes / 1e9,
            }
        )
    return rows


# --- Parallel compiles --------------------------------------------------------------------------


def _compile(job: tuple[LinearTiles, str, tuple[int, ...]]) -> None:
    """Runs `tiles` once per kernel the sweep needs, on small tensors specialised as the real
    ones are (N, K and strides divisible by 16, K a multiple of block_k): Triton caches them."""
    tiles, dtype_name, ms = job
    dtype = DTYPES[dtype_name]
    weight = torch.randn(256, 1024, device=DEVICE).to(dtype)  # [N, K]
    row_tiles = {tiles.rows(m): m for m in ms}  # one M per compiled row tile
    for m in row_tiles.values():
        x = torch.randn(m, 1024, device=DEVICE).to(dtype)  # [M, K]
        with contextlib.suppress(Exception):  # the sweep reports it
            skinny_linear(x, weight, tiles=tiles)
    torch.cuda.synchronize()


def precompile(configs: list[LinearTiles], dtype_name: str, ms: tuple[int, ...], jobs: int) -> None:
    """Compiles every config in `jobs` processes at once (Triton compiles one at a time)."""
    if jobs <= 0:
        return
    started = time.perf_counter()
    try:
        with multiprocessing.get_context("spawn").Pool(min(jobs, len(configs))) as pool:
            pool.map(_compile, [(tiles, dtype_name, ms) for tiles in configs])
    except Exception as error:  # compiles then happen in the sweep, only slower
        print(f"[compile] parallel compile failed ({error}); compiling serially", flush=True)
        return
    print(f"[compile] {len(configs)} configs in {time.perf_counter() - started:.1f} s", flush=True)


# --- Report -------------------------------------------------------------------------------------


def print_table(results: list[dict[str, Any]], best: dict[tuple[str, int], dict[str, Any]]) -> None:
    """Per shape and M: torch, and the best Triton config (the last lines printed)."""
    torch_rows = {(r["shape"], r["m"]): r for r in results if r["tiles"] is None}
    print(f"{'shape':<11}{'M':>3}{'torch us':>10}{'GB/s':>7}{'best us':>10}{'GB/s':>7}"
          f"{'speedup':>9}  best config")  # fmt: skip
    for key, ref in torch_rows.items():
        row = best.get(key)
        if row is None:
            print(f"{key[0]:<11}{key[1]:>3}{ref['us']:>10.1f}{ref['gb_per_s']:>7.0f}  no config")
            continue
        print(f"{key[0]:<11}{key[1]:>3}{ref['us']:>10.1f}{ref['gb_per_s']:>7.0f}"
              f"{row['us']:>10.1f}{row['gb_per_s']:>7.0f}{ref['us'] / row['us']:>8.2f}x"
              f"  {row['impl']}")  # fmt: skip


def print_steps(steps: list[dict[str, Any]]) -> None:
    for s in steps:
        print(f"step M={s['m']:<3} {s['variant']:<15} {s['ms']:7.3f} ms  {s['gb_per_s']:6.0f} GB/s"
              f"  (floor {s['floor_ms']:.3f} ms at 3.0 TB/s, {s['weight_gb']:.2f} GB)")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("linear_sweep.json"), help="JSON path")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="llama", help="shapes")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 8, 16], help="rows, 1..64")
    parser.add_argument("--step-m", type=int, nargs="+", default=[1, 8], help="M of step timings")
    parser.add_argument("--layers", type=int, help="weight copies per shape (default: the model's)")
    parser.add_argument("--jobs", type=int, default=8, help="compile processes; 0: in the sweep")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not all(1 <= m <= MAX_ROWS for m in args.m) or not set(args.step_m) <= set(args.m):
        parser.error(f"--m must be in 1..{MAX_ROWS}, and --step-m a subset of --m")
    args.layers = args.layers or MODEL_LAYERS[args.model]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("linear_sweep.py times kernels on a CUDA GPU, and none is visible")
    started = time.perf_counter()
    dtype = DTYPES[args.dtype]
    print(f"[device] {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, {args.dtype}", flush=True)  # fmt: skip
    precompile(CANDIDATES, args.dtype, tuple(args.m), args.jobs)
    shapes = MODEL_SHAPES[args.model]
    weights = make_weights(shapes, args.layers, dtype, args.seed)
    inputs = {(s.name, m): make_input(s, m, dtype, seed=m) for s in shapes for m in args.m}
    results, skipped = sweep_impl(None, shapes, inputs, weights)
    for index, tiles in enumerate(CANDIDATES):
        tick = time.perf_counter()
        rows, skips = sweep_impl(tiles, shapes, inputs, weights)
        results, skipped = results + rows, skipped + skips
        print(f"[{index + 1}/{len(CANDIDATES)}] {label(tiles)}: {len(rows)} timed, "
              f"{len(skips)} skipped, {time.perf_counter() - tick:.1f} s", flush=True)  # fmt: skip
        report_skips(skips)
    best = best_results(results)
    steps = [row for m in args.step_m for row in time_steps(best, shapes, weights, m, args.layers)]
    report = {
        "benchmark": "linear_sweep",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "model": args.model,
        "layers": args.layers,
        "candidates": [dataclasses.asdict(t) for t in CANDIDATES],
        "results": results,
        "skipped": skipped,
        "best": [best[key] for key in sorted(best)],
        "steps": steps,
        "elapsed_s": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"[done] {report['elapsed_s']:.0f} s, wrote {args.out}")
    print_steps(steps)
    print_table(results, best)
    return 0


if __name__ == "__main__":
    with exact_stages():  # a candidate runs as labelled, or is skipped as not fitting
        sys.exit(main())
