"""Where a MoE layer's time goes (GPU): each kernel's device time at several token counts, at
Qwen3-30B-A3B's layer shape, bf16 and FP8 experts; and `align` three ways at the pair counts
where they meet (one program, three parallel launches, the torch reference: the bound between
the first two, kernels/triton_moe_align.ONE_PROGRAM_MAX_PAIRS, is to be set from it):

    python3 -m sweeps.moe_profile --out moe_profile.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from kernels import ops, triton_moe_align
from kernels.fp8 import quantize_fp8_rowwise_reference
from kernels.moe import align_reference
from kernels.triton_moe_align import ONE_PROGRAM_MAX_PAIRS, align

NUM_E, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def kernel_us(run: Any, repeats: int = 20) -> dict[str, float]:
    """Each kernel's device microseconds a call of `run`."""
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.device_type.name == "CUDA":
            totals[event.key[:60]] += event.self_device_time_total / repeats
    return {name: round(us, 1) for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 16384])
    parser.add_argument("--out", type=Path, default=Path("moe_profile.json"))
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    w13 = randn(NUM_E, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5)
    w2 = randn(NUM_E, HIDDEN, INTER, scale=INTER**-0.5)
    q13, s13 = quantize_fp8_rowwise_reference(w13.view(-1, HIDDEN))
    q2, s2 = quantize_fp8_rowwise_reference(w2.view(-1, INTER))
    fp8 = (q13.view(w13.shape), q2.view(w2.shape), s13.view(NUM_E, -1, 1), s2.view(NUM_E, -1, 1))
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "layers": {}, "align": []}
    for tokens in args.tokens:
        x, logits = randn(tokens, HIDDEN), randn(tokens, NUM_E)

        def bf16(x: torch.Tensor = x, logits: torch.Tensor = logits) -> None:
            weights, ids = ops.moe_route(logits, TOP_K, renormalize=True)
            ops.moe_experts(x, w13, w2, weights, ids)

        def fp8_experts(x: torch.Tensor = x, logits: torch.Tensor = logits) -> None:
            weights, ids = ops.moe_route(logits, TOP_K, renormalize=True)
            ops.moe_experts(x, fp8[0], fp8[1], weights, ids, fp8[2], fp8[3])

        result["layers"][tokens] = {"bf16": kernel_us(bf16), "fp8": kernel_us(fp8_experts)}
        print(tokens, json.dumps(result["layers"][tokens]), flush=True)
    for pairs in (512, 2048, 8192, 32768):
        ids = torch.randint(0, NUM_E, (pairs // TOP_K, TOP_K), device="cuda", generator=gen)
        row: dict[str, Any] = {"pairs": pairs}
        for name, bound in (("one_program", 1 << 30), ("parallel", 0), ("torch", None)):
            if name == "one_program" and pairs > 8192:
                continue  # one program's walk: far slower by then
            if bound is not None:
                triton_moe_align.ONE_PROGRAM_MAX_PAIRS = bound
            fn = align if bound is not None else align_reference
            ms = do_bench(lambda fn=fn, ids=ids: fn(ids, NUM_E, 16), rep=50)
            row[name] = round(1000 * ms, 1)
        triton_moe_align.ONE_PROGRAM_MAX_PAIRS = ONE_PROGRAM_MAX_PAIRS
        result["align"].append(row)
        print(row, flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
