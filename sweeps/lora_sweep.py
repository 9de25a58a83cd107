"""LoRA shrink and expand launch configs at Llama-3.1-8B shapes: microseconds per call.

For each step size in --tokens (tokens spread evenly over 8 adapters, sorted by slot as the
executor passes them), times `kernels.triton_lora.lora_shrink` and `lora_expand` for every
projection with the default config and the CANDIDATES, and reports the bytes the expand must
move at least (its output read and written) over the time.

    python -m sweeps.lora_sweep --out $OUT/lora_sweep.json --tokens 32 256 8192

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton.testing

from kernels.triton_lora import lora_expand, lora_shrink

HIDDEN, INTERMEDIATE, Q, KV = 4096, 14336, 4096, 1024
# projection -> (input columns, output rows of each piece)
PROJECTIONS = {
    "qkv": (HIDDEN, (Q, KV, KV)),
    "o": (Q, (HIDDEN,)),
    "gate_up": (HIDDEN, (INTERMEDIATE, INTERMEDIATE)),
    "down": (INTERMEDIATE, (HIDDEN,)),
}
SLOTS, RANK = 8, 16
EXPAND_CANDIDATES = [(16, 64), (16, 128), (16, 256), (32, 128), (64, 128), (64, 64), (32, 256)]


def case(tokens: int, k: int, pieces: tuple[int, ...]):
    slots = (torch.arange(tokens) % SLOTS).to(torch.int32)
    order = torch.sort(slots, stable=True).indices.to(torch.int32).cuda()
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    lora_a = torch.randn(SLOTS, len(pieces), RANK, k, device="cuda", dtype=torch.bfloat16)
    lora_b = torch.randn(SLOTS, sum(pieces), RANK, device="cuda", dtype=torch.bfloat16)
    out = torch.randn(tokens, sum(pieces), device="cuda", dtype=torch.bfloat16)
    return x, lora_a, lora_b, slots.cuda(), order, out


def time_us(fn) -> float:
    return 1000 * triton.testing.do_bench(fn, warmup=25, rep=100)


def sweep(tokens: int) -> list[dict[str, object]]:
    return [time_projection(tokens, name, *shape) for name, shape in PROJECTIONS.items()]


def time_projection(tokens: int, name: str, k: int, pieces: tuple[int, ...]) -> dict[str, object]:
    x, lora_a, lora_b, slots, order, out = case(tokens, k, pieces)
    shrunk = lora_shrink(x, lora_a, slots, order)

    def expand(block_t: int | None = None, block_n: int | None = None) -> None:
        lora_expand(out, shrunk, lora_b, slots, pieces, order, block_t=block_t, block_n=block_n)

    expand_us = time_us(expand)
    floor_bytes = 2 * out.numel() * out.element_size()  # out read and written
    row: dict[str, object] = {
        "tokens": tokens,
        "projection": name,
        "shrink_us": round(time_us(lambda: lora_shrink(x, lora_a, slots, order)), 2),
        "expand_us": round(expand_us, 2),
        "expand_gb_per_s": round(floor_bytes / expand_us / 1e3, 1),
    }
    for block_t, block_n in EXPAND_CANDIDATES if tokens > 16 else []:
        us = time_us(lambda bt=block_t, bn=block_n: expand(bt, bn))
        row[f"expand_{block_t}x{block_n}_us"] = round(us, 2)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 256, 8192])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = [row for tokens in args.tokens for row in sweep(tokens)]
    report = {"device": torch.cuda.get_device_name(), "results": results}
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
