"""What `--batch-invariant` costs a decode step at batch 1, kernel by kernel: the skinny linear
layer at one row (its GEMV against the 16-row tensor-core tile) at Qwen3-8B's shapes, and the
split-KV decode attention at one request (picked splits and 16-row pads against fixed 256-token
splits and 64-row pads), each timed with the switch off and on.

    python -m sweeps.invariance_cost --out $OUT/invariance_cost.json

Needs a CUDA GPU; under a minute.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.kernel_bench import decode_case, median_ms
from kernels.invariance import set_batch_invariant
from kernels.triton_decode_attention import paged_decode_attention
from kernels.triton_linear import skinny_linear

# Qwen3-8B's projections (N, K) and their count in a step.
LINEARS = {
    "qkv": (6144, 4096, 36),
    "o": (4096, 4096, 36),
    "gate_up": (24576, 4096, 36),
    "down": (4096, 12288, 36),
    "lm_head": (151936, 4096, 1),
}
CONTEXTS = (384, 4096)  # tokens of one request's context


def both_ways(fn: Callable[[], Any]) -> dict[str, float]:
    """fn's median microseconds with the switch off, then on."""
    times = {}
    for name, on in (("plain_us", False), ("invariant_us", True)):
        set_batch_invariant(on)
        times[name] = median_ms(fn) * 1e3
    set_batch_invariant(False)
    return times


def linear_costs() -> dict[str, dict[str, float]]:
    out = {}
    for name, (n, k, _) in LINEARS.items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        out[name] = both_ways(lambda x=x, weight=weight: skinny_linear(x, weight))
    return out


def attention_costs() -> dict[str, dict[str, float]]:
    out = {}
    for context in CONTEXTS:
        (query, key_cache, value_cache, tables, lens), _ = decode_case(
            1, context, 32, 8, 128, torch.bfloat16
        )
        wide = torch.zeros(1, 4096 // 16 * 2, dtype=torch.int32, device="cuda")
        wide[:, : tables.shape[1]] = tables  # the engine's table: max_model_len 8192

        def attend(q=query, k=key_cache, v=value_cache, t=wide, s=lens) -> torch.Tensor:
            return paged_decode_attention(q, k, v, t, s, 128**-0.5)

        out[str(context)] = both_ways(attend)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    linears, attention = linear_costs(), attention_costs()
    step = {
        mode: sum(linears[name][mode] * LINEARS[name][2] for name in LINEARS)
        + 36 * attention[str(CONTEXTS[0])][mode]
        for mode in ("plain_us", "invariant_us")
    }
    result = {"linear": linears, "attention": attention, "step_sum_at_384": step}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
