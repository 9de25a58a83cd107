"""FP8 experts' error: the Triton grouped GEMMs (kernels/triton_moe.py) against
`kernels.moe.moe_experts_reference` on the same inputs, at Qwen3-30B-A3B's layer shape and two
small ones (GPU):

    python3 -m sweeps.moe_fp8_error

Prints the relative error at each (the norm of the difference over the reference's): what FP8
costs beyond the reference's own e4m3 rounding (the tensor cores' FP8 accumulation, the order
of the sums). On an H100 (2026-12-06) 0.27 % at Qwen3-30B-A3B's shape."""

from __future__ import annotations

import torch

from kernels.moe import moe_experts_reference
from kernels.triton_moe import moe_experts_grouped
from kernels.triton_moe_route import moe_route


def fp8_experts(num: int, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = (torch.randn(num, rows, cols, generator=generator) * 64).to(torch.float8_e4m3fn)
    scale = torch.rand(num, rows, 1, generator=generator) / (64 * cols**0.5) + 1e-5
    return q.cuda(), scale.cuda()


def relative(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference.float()).norm() / reference.float().norm()).item()


def main() -> None:
    for tokens, hidden, inter, experts, top_k in ((256, 2048, 768, 128, 8), (300, 208, 80, 6, 2),
                                                  (256, 256, 128, 16, 2)):  # fmt: skip
        gate_up, gate_up_scale = fp8_experts(experts, 2 * inter, hidden, tokens)
        down, down_scale = fp8_experts(experts, hidden, inter, tokens + 1)
        generator = torch.Generator().manual_seed(3)
        x = torch.randn(tokens, hidden, generator=generator).cuda().bfloat16()
        logits = torch.randn(tokens, experts, generator=generator).cuda()
        weights, ids = moe_route(logits, top_k, renormalize=True)
        scales = (gate_up_scale, down_scale)
        reference = moe_experts_reference(x, gate_up, down, weights, ids, *scales)
        triton_out = moe_experts_grouped(x, gate_up, down, weights, ids, None, *scales)
        row = {"shape": (tokens, hidden, inter, experts, top_k),
               "triton": round(relative(triton_out, reference), 5)}  # fmt: skip
        print(row, flush=True)


if __name__ == "__main__":
    main()
