"""The MoE GEMV kernels' tiles (kernels/triton_moe.py, `GemvTiles`) at decode batch sizes,
against the grouped GEMMs on the same inputs, at Qwen3-30B-A3B's layer shape (GPU):

    python3 -m sweeps.moe_gemv_sweep --out moe_gemv_sweep.json
    python3 -m sweeps.moe_gemv_sweep --fp8 --out moe_gemv_sweep_fp8.json   # FP8 experts

Each figure is a layer's routing and experts, microseconds, timed as `kvflow bench moe` does
(4 layers of weights from one CUDA graph).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from benchmarks.moe_bench import fp8_rows, time_layers
from kernels import ops
from kernels.triton_moe import moe_experts_grouped
from kernels.triton_moe_gemv import moe_experts_gemv
from kernels.triton_moe_tiles import GemvTiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=Path("moe_gemv_sweep.json"))
    parser.add_argument(
        "--fp8", action="store_true", help="FP8 experts, a scale a row (FP8_GEMV_TILES')"
    )
    args = parser.parse_args()
    num_e, top_k, hidden, inter, layers = 128, 8, 2048, 768, 4
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)

    weights = [
        expert_weights(randn(num_e, 2 * inter, hidden), randn(num_e, hidden, inter), args.fp8)
        for _ in range(layers)
    ]
    variants = {"grouped": moe_experts_grouped}
    gate_ups = [(8, 256), (8, 512), (4, 512), (16, 256)]  # (columns, K) a program step
    downs = [(8, 256), (4, 256), (4, 512), (2, 512), (8, 512)]
    if args.fp8:  # FP8 tiles move half the bytes a load: larger ones are tried too
        gate_ups += [(16, 512), (8, 1024)]
        downs += [(4, 1024), (16, 256)]
    for (gn, gk), (dn, dk), warps in itertools.product(gate_ups, downs, [4, 8]):
        tiles = GemvTiles(gn, gk, dn, dk, warps)

        def gemv(x, gate_up, down, w, ids, _, up_s, down_s, tiles=tiles):  # type: ignore[no-untyped-def]
            return moe_experts_gemv(x, gate_up, down, w, ids, tiles, up_s, down_s)

        variants[f"g{gn}x{gk} d{dn}x{dk} w{warps}"] = gemv
    rows = []
    for batch in args.batch_sizes:
        x = randn(batch, hidden)
        logits = [randn(batch, num_e) for _ in range(layers)]
        for name, experts in variants.items():

            def moe(x, logits, w13, w2, k, experts=experts):  # type: ignore[no-untyped-def]
                weights_, ids = ops.moe_route(logits, k, renormalize=True)
                return experts(x, w13[0], w2[0], weights_, ids, None, w13[1], w2[1])

            us = 1000 * time_layers(moe, x, logits, weights, top_k)
            rows.append({"batch_size": batch, "variant": name, "us": round(us, 1)})
        best = sorted((r for r in rows if r["batch_size"] == batch), key=lambda r: r["us"])[:5]
        print(batch, best, flush=True)
    report = {"device": torch.cuda.get_device_name(), "fp8": args.fp8, "rows": rows}
    args.out.write_text(json.dumps(report, indent=1))


def expert_weights(
    gate_up: torch.Tensor, down: torch.Tensor, fp8: bool
) -> tuple[tuple[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]:
    """A layer's experts, each (weight, its FP8 scales or None): as `--quantization fp8`
    makes them with `fp8`, else bf16."""
    if fp8:
        return fp8_rows(gate_up), fp8_rows(down)
    return (gate_up, None), (down, None)


if __name__ == "__main__":
    main()
