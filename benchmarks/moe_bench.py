"""`kvflow bench moe`: one mixture-of-experts layer (routing and experts, microseconds a layer)
against the bytes it must read, and against vLLM's fused MoE on the same inputs where vLLM is
importable.

    kvflow bench moe --batch-sizes 1 4 16 64 256 --peer vllm --output-json moe.json
    kvflow bench moe --batch-sizes 256 1024 16384 --peer vllm --fp8   # FP8 experts, both engines

The default shape is Qwen3-30B-A3B's (128 experts, top 8, hidden 2048, experts' width 768).
Each engine's call runs over `--layers` layers of random bf16 weights (4 x 1.2 GB: beyond L2,
as in a model) from one CUDA graph, so the time is the device's with no launch gaps from
Python, as in a decode step. The routing logits are random: tokens spread over the experts as
evenly as a trained router's do at best. The floor counts each layer's distinct chosen experts'
weights, read once, at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.kernel_bench import copy_bandwidth_gbs, median_ms

MoeCall = Callable[[torch.Tensor, torch.Tensor, Any, Any, int], torch.Tensor]


def kvflow_moe(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               top_k: int) -> torch.Tensor:  # fmt: skip
    from kernels import ops

    weights, ids = ops.moe_route(logits, top_k, renormalize=True)
    return ops.moe_experts(x, w13, w2, weights, ids)


def kvflow_int4_moe(x: torch.Tensor, logits: torch.Tensor, w13: Any, w2: Any,
                    top_k: int) -> torch.Tensor:  # fmt: skip
    from kernels import ops

    weights, ids = ops.moe_route(logits, top_k, renormalize=True)
    return ops.moe_experts_int4(x, w13, w2, weights, ids)


def kvflow_fp8_moe(x: torch.Tensor, logits: torch.Tensor, w13: Any, w2: Any,
                   top_k: int) -> torch.Tensor:  # fmt: skip
    from kernels import ops

    weights, ids = ops.moe_route(logits, top_k, renormalize=True)
    return ops.moe_experts(x, w13[0], w2[0], weights, ids, w13[1], w2[1])


def fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kvflow's FP8 experts [E, rows, cols], as `--quantization fp8` makes them: e4m3 with a
    scale a row ([E, rows, 1] float32)."""
    from kernels.fp8 import quantize_fp8_rowwise_reference

    q, scale = quantize_fp8_rowwise_reference(weight.flatten(0, 1))
    return q.view(weight.shape), scale.view(*weight.shape[:2], 1)


def fp8_per_expert(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's online FP8 experts (`--quantization fp8` on bf16 weights): e4m3 with one scale
    an expert ([E] float32)."""
    scale = weight.float().abs().amax(dim=(1, 2)).clamp(min=1e-12) / 448.0
    return (weight.float() / scale[:, None, None]).to(torch.float8_e4m3fn), scale


def vllm_fp8_moe(x: torch.Tensor, logits: torch.Tensor, w13: Any, w2: Any,
                 top_k: int) -> torch.Tensor:  # fmt: skip
    """vLLM's Triton fused MoE, W8A8 as its engine runs `--quantization fp8`: per-expert
    weight scales, the activations' scales dynamic (one a tensor)."""
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

    weights, ids, _ = fused_topk(x, logits, top_k, renormalize=True)
    config = fp8_w8a8_moe_quant_config(w1_scale=w13[1], w2_scale=w2[1])
    return fused_experts(x, w13[0], w2[0], weights, ids, quant_config=config)


def fp8_engines(
    weights: list[tuple[Any, Any]], peer: str
) -> dict[str, tuple[MoeCall, list[tuple[Any, Any]]]]:
    """FP8 experts each engine's way, from the same bf16 weights."""
    engines = {"kvflow_fp8": (kvflow_fp8_moe, [(fp8_rows(a), fp8_rows(b)) for a, b in weights])}
    if peer == "vllm":
        engines["vllm_fp8"] = (vllm_fp8_moe, [(fp8_per_expert(a), fp8_per_expert(b))
                                              for a, b in weights])  # fmt: skip
    return engines


def int4_stack(experts: int, rows: int, cols: int, generator: torch.Generator) -> Any:
    """Random int4 experts as a checkpoint's: groups of 128 with zero points, the weights'
    spread about cols ** -0.5."""
    from kernels.int4 import Int4Stack

    words = torch.randint(-(2**31), 2**31, (experts, rows, cols // 8), generator=generator,
                          device="cuda", dtype=torch.int64).to(torch.int32)  # fmt: skip
    groups = (experts, rows, cols // 128)
    scales = torch.full(groups, 0.25 * cols**-0.5, device="cuda", dtype=torch.bfloat16)
    zeros = torch.randint(6, 11, groups, generator=generator, device="cuda").to(torch.uint8)
    return Int4Stack(words, scales, zeros, 128)


def vllm_moe(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             top_k: int) -> torch.Tensor:  # fmt: skip
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

    weights, ids, _ = fused_topk(x, logits, top_k, renormalize=True)
    return fused_experts(x, w13, w2, weights, ids)


def graph_ms(run: Callable[[], object]) -> float:
    """The device time of `run` replayed from a CUDA graph (captured after two eager runs)."""
    run()
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return median_ms(graph.replay)


def distinct_expert_bytes(logits: list[torch.Tensor], top_k: int, per_expert: int) -> int:
    """Each layer's chosen experts' weights, each read once."""
    chosen = [torch.topk(layer, top_k, dim=-1).indices.unique().numel() for layer in logits]
    return sum(chosen) * per_expert


def time_layers(
    moe: MoeCall,
    x: torch.Tensor,
    logits: list[torch.Tensor],
    weights: list[tuple[Any, Any]],
    top_k: int,
) -> float:
    """Milliseconds a layer: `moe` over every layer's weights, from one CUDA graph."""

    def run() -> None:
        for layer_logits, (w13, w2) in zip(logits, weights, strict=True):
            moe(x, layer_logits, w13, w2, top_k)

    return graph_ms(run) / len(weights)


def moe_bench(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    copy_gbs = copy_bandwidth_gbs()
    num_e, hidden, inter = args.num_experts, args.hidden_size, args.intermediate_size
    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        out = torch.randn(*shape, device="cuda", generator=generator) * scale
        return out.to(torch.bfloat16)

    w13 = [randn(num_e, 2 * inter, hidden, scale=hidden**-0.5) for _ in range(args.layers)]
    w2 = [randn(num_e, hidden, inter, scale=inter**-0.5) for _ in range(args.layers)]
    weights = list(zip(w13, w2, strict=True))
    engines: dict[str, tuple[MoeCall, list[tuple[Any, Any]]]] = {"kvflow": (kvflow_moe, weights)}
    if args.peer == "vllm":
        engines["vllm"] = (vllm_moe, weights)
    if args.fp8:
        engines.update(fp8_engines(weights, args.peer))
    if args.int4:
        int4 = [
            (int4_stack(num_e, 2 * inter, hidden, generator),
             int4_stack(num_e, hidden, inter, generator))
            for _ in range(args.layers)
        ]  # fmt: skip
        engines["kvflow_int4"] = (kvflow_int4_moe, int4)
        int4_bytes = sum(t.numel() * t.element_size() for stack in int4[0] for t in stack[:3])
    rows = []
    for batch in args.batch_sizes:
        x = randn(batch, hidden)
        logits = [randn(batch, num_e) for _ in range(args.layers)]
        floor_ms = distinct_expert_bytes(logits, args.top_k, 6 * inter * hidden) / copy_gbs / 1e6
        row: dict[str, Any] = {"batch_size": batch}
        row["floor_us"] = round(1000 * floor_ms / args.layers, 1)
        if args.int4:
            per_expert = int4_bytes // num_e
            int4_ms = distinct_expert_bytes(logits, args.top_k, per_expert) / copy_gbs / 1e6
            row["int4_floor_us"] = round(1000 * int4_ms / args.layers, 1)
        for name, (moe, layer_weights) in engines.items():
            try:
                ms = time_layers(moe, x, logits, layer_weights, args.top_k)
            except Exception as exc:  # a peer that cannot run is reported, not fatal
                row[f"{name}_error"] = repr(exc)[:300]
                continue
            row[f"{name}_us"] = round(1000 * ms, 1)
            floor = int4_ms if name == "kvflow_int4" else floor_ms
            floor = floor / 2 if name.endswith("_fp8") else floor  # a byte a weight
            row[f"{name}_fraction_of_floor"] = round(floor / args.layers / ms, 3)
        rows.append(row)
        print(row, flush=True)
    return {
        "benchmark": "moe",
        "device": torch.cuda.get_device_name(),
        "copy_gb_per_s": round(copy_gbs, 1),
        "shape": {"num_experts": num_e, "top_k": args.top_k, "hidden_size": hidden,
                  "intermediate_size": inter, "dtype": "bfloat16", "layers": args.layers},
        "results": rows,
    }  # fmt: skip
