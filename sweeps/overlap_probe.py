"""Can decode attention (memory-bound) and the linear layers (compute-bound at large batches)
run at the same time on one GPU? The question behind a decode step of two nano-batches.

Times three CUDA graphs at Qwen3-8B decode shapes, every layer's weights and KV distinct so
nothing is served from L2:
  attention   36 layers of split-KV decode attention for --batch requests of --context tokens
  linear      36 layers of qkv, o, gate_up and down (cuBLAS) for --batch rows
  both        the two above on two streams at once, forked and joined inside one graph
and reports `both` against the sum and the larger of the two: a sum means the kernels take
turns on the SMs, the larger one means they overlap fully.

    python -m sweeps.overlap_probe --batch 128 --context 640 --out $OUT/overlap.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels.triton_decode_attention import paged_decode_attention
from sweeps.linear_sweep import capture, time_graph

LAYERS = 36
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
LINEAR_SHAPES = {  # (N, K) of Qwen3-8B's projections
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
}
BLOCK_SIZE = 16


def make_attention(batch: int, context: int, device: torch.device) -> Callable[[], None]:
    """36 layers of decode attention, each over its own KV cache, blocks shuffled."""
    blocks_per_req = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_req
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [
        (
            torch.randn(shape, device=device, dtype=torch.bfloat16),
            torch.randn(shape, device=device, dtype=torch.bfloat16),
        )
        for _ in range(LAYERS)
    ]
    tables = torch.randperm(num_blocks, device=device, dtype=torch.int64).to(torch.int32)
    tables = tables.view(batch, blocks_per_req)
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    query = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    scale = HEAD_DIM**-0.5

    def run() -> None:
        for key_cache, value_cache in caches:
            paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale)

    return run


def make_linear(batch: int, device: torch.device) -> Callable[[], None]:
    """36 layers of the four projections on `batch` rows, each layer its own weights."""
    weights = [
        {name: torch.randn(n, k, device=device, dtype=torch.bfloat16) for name, (n, k) in
         LINEAR_SHAPES.items()}
        for _ in range(LAYERS)
    ]  # fmt: skip
    inputs = {
        name: torch.randn(batch, k, device=device, dtype=torch.bfloat16)
        for name, (_, k) in LINEAR_SHAPES.items()
    }

    def run() -> None:
        for layer in weights:
            for name, weight in layer.items():
                F.linear(inputs[name], weight)

    return run


def concurrently(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    """Both on two streams forked from the current one and joined back (capturable)."""
    side = torch.cuda.Stream()

    def run() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            second()
        first()
        main.wait_stream(side)

    return run


def measure(run: Callable[[], None]) -> float:
    graph = capture(run)
    seconds = time_graph(graph)
    del graph
    return seconds * 1e3


def overlap_row(
    batch: int,
    context: int,
    carveout: int,
    attention_ms: float,
    linear: Callable[[], None],
    attention: Callable[[], None],
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "batch": batch,
        "context": context,
        "carveout_sms": carveout,
        "attention_ms": attention_ms,
        "linear_ms": measure(linear),
        "both_ms": measure(concurrently(attention, linear)),
    }
    row["sum_ms"] = row["attention_ms"] + row["linear_ms"]
    row["max_ms"] = max(row["attention_ms"], row["linear_ms"])
    row["saved_of_possible"] = (row["sum_ms"] - row["both_ms"]) / (row["sum_ms"] - row["max_ms"])
    print(
        f"batch {batch}, {carveout} SMs kept from the GEMMs: attention "
        f"{row['attention_ms']:.2f} ms, linear {row['linear_ms']:.2f} ms, both at once "
        f"{row['both_ms']:.2f} ms (sum {row['sum_ms']:.2f}, max {row['max_ms']:.2f}: "
        f"{row['saved_of_possible']:.0%} of the possible overlap)",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument(
        "--carveouts",
        type=int,
        nargs="*",
        default=[0, 16, 32, 48],
        help="SMs kept from cuBLASLt GEMMs (torch's experimental SM carveout), one run each",
    )
    parser.add_argument("--out", type=Path, default=Path("overlap.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("overlap_probe.py times kernels on a CUDA GPU, and none is visible")
    device = torch.device("cuda")
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    if any(args.carveouts):
        torch.backends.cuda.preferred_blas_library("cublaslt")  # the carveout is cuBLASLt's
    for batch in args.batch:
        attention = make_attention(batch, args.context, device)
        linear = make_linear(batch, device)
        attention_ms = measure(attention)
        for carveout in args.carveouts:
            torch._C._set_sm_carveout_experimental(carveout or None)
            row = overlap_row(batch, args.context, carveout, attention_ms, linear, attention)
            rows.append(row)
        torch._C._set_sm_carveout_experimental(None)
        del attention, linear
        torch.cuda.empty_cache()
    report = {
        "benchmark": "overlap_probe",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "sm_carveout_available": hasattr(torch._C, "_set_sm_carveout_experimental"),
        "rows": rows,
        "elapsed_s": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
