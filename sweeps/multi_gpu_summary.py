"""Issue 51's table from the results of `scripts/device_multi_gpu.sh`: each measure on N GPUs
against one GPU (or against vLLM, or against two data-parallel replicas), its ratio, and the
issue's target. A measure whose results are missing prints as not run.

    python -m sweeps.multi_gpu_summary bench-out/multi-gpu --gpus 2
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Kernels of the all-reduce that joins the ranks' partial sums (NCCL's, or the fused
# all-reduce + residual add + RMSNorm).
ALL_REDUCE = re.compile(r"nccl|all_?reduce", re.IGNORECASE)


@dataclass(frozen=True)
class Row:
    measure: str
    ours: float | None  # the N-GPU figure
    base: float | None  # what it is held against
    target: str | None  # e.g. "<= 0.6" or ">= 1.9"; None: the issue sets none

    @property
    def ratio(self) -> float | None:
        if self.ours is None or not self.base:
            return None
        return self.ours / self.base

    @property
    def met(self) -> bool | None:
        if self.ratio is None or self.target is None:
            return None
        op, bound = self.target.split()
        return self.ratio <= float(bound) if op == "<=" else self.ratio >= float(bound)

    def line(self) -> str:
        if self.ratio is None:
            return f"{self.measure:<58} not run"
        verdict = "no target" if self.met is None else "met" if self.met else "MISSED"
        return (
            f"{self.measure:<58} {self.ours:>10.3f} / {self.base:<10.3f} = {self.ratio:6.3f}"
            f"  ({self.target or ''}{': ' if self.target else ''}{verdict})"
        )


def load(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def dig(data: dict[str, Any] | None, *keys: str) -> float | None:
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return float(data) if isinstance(data, int | float) else None


def batch1_itl(data: dict[str, Any] | None) -> float | None:
    """`kvflow bench latency`'s median inter-token latency at batch 1."""
    for result in (data or {}).get("results", []):
        if result.get("batch_size") == 1:
            return float(result["itl_ms_median"])
    return None


def mean_of(
    folder: Path, pattern: str, read: Callable[[dict[str, Any]], float | None]
) -> float | None:
    read_all = (read(json.loads(path.read_text())) for path in sorted(folder.glob(pattern)))
    values = [value for value in read_all if value is not None]
    return statistics.mean(values) if values else None


def served_tok_s(data: dict[str, Any]) -> float | None:
    """`kvflow bench serve`'s output tokens a second at its last (highest) request rate."""
    runs = data.get("runs") or [{}]
    return dig(runs[-1], "output_throughput")


def all_reduce_share(data: dict[str, Any] | None) -> float | None:
    """The all-reduce kernels' share of a profiled decode step's kernel time (its top kernels;
    kernels overlap under programmatic dependent launch, so the total is their sum)."""
    profile = (data or {}).get("decode_profile")
    if not profile or not profile.get("kernel_ms_per_step"):
        return None
    top = profile.get("top_kernels_ms_per_step", {})
    reduce_ms = sum(ms for name, ms in top.items() if ALL_REDUCE.search(name))
    return float(reduce_ms / profile["kernel_ms_per_step"])


def rows(folder: Path, n: int) -> list[Row]:
    def tok_s(name: str, *keys: str) -> float | None:
        return dig(load(folder, name), *keys, "output_tok_per_s")

    def serve_tok_s(pattern: str) -> float | None:
        return mean_of(folder, pattern, served_tok_s)

    tp_itl = batch1_itl(load(folder, f"latency_tp{n}.json"))
    vllm_tp_itl = dig(load(folder, f"Llama-3.1-8B_vllm_tp{n}.json"), "latency", "itl_ms")
    pd = load(folder, "disaggregation.json") or {}
    split, pair = pd.get("disaggregated", {}), pd.get("baseline", {})
    return [
        Row(f"TP={n} / TP=1 batch-1 ITL, Llama-3.1-8B", tp_itl,
            batch1_itl(load(folder, "latency.json")), "<= 0.6"),
        Row(f"TP={n} / TP=1 offline tok/s", tok_s(f"throughput_tp{n}.json"),
            tok_s("throughput.json"), ">= 1.6"),
        Row(f"kvflow / vLLM batch-1 ITL at TP={n}", tp_itl, vllm_tp_itl, "<= 0.9"),
        Row(f"DP={n} / DP=1 offline tok/s, 1,024 prompts", tok_s(f"throughput_dp{n}_1024.json"),
            tok_s("throughput_dp1_1024.json"), f">= {0.95 * n:g}"),
        Row(f"DP={n} / DP=1 serve output tok/s, mean of the loads",
            serve_tok_s(f"dp{n}_load*.json"), serve_tok_s("dp1_load*.json"), f">= {0.925 * n:g}"),
        Row(f"EP={n} / one GPU offline tok/s, Qwen3-30B-A3B", tok_s(f"moe_ep{n}.json"),
            tok_s("moe_tp1.json"), None),
        Row(f"kvflow / vLLM offline tok/s at EP={n}", tok_s(f"moe_ep{n}.json"),
            tok_s(f"Qwen3-30B-A3B_vllm_ep{n}.json", "offline"), None),
        Row(f"EP over DP={n} / one GPU offline tok/s, Qwen3-30B-A3B", tok_s(f"moe_dpep{n}.json"),
            tok_s("moe_tp1.json"), None),
        Row(f"EP over DP={n}: CUDA graphs / eager offline tok/s", tok_s(f"moe_dpep{n}.json"),
            tok_s(f"moe_dpep{n}_eager.json"), None),
        Row("P/D pair / DP pair decode TPOT p99", dig(split, "serve", "p99_tpot_ms"),
            dig(pair, "serve", "p99_tpot_ms"), "<= 0.5"),
        Row("P/D pair / DP pair TTFT median", dig(split, "serve", "median_ttft_ms"),
            dig(pair, "serve", "median_ttft_ms"), "<= 1.2"),
    ]  # fmt: skip


def notes(folder: Path, n: int) -> list[str]:
    """What has no target: the experts' balance over the ranks, the all-reduce's share, the
    KV handover's bandwidth against the host-to-GPU copy."""
    lines = []
    moe = load(folder, f"moe_ep{n}.json")
    experts = (moe or {}).get("expert_load", {})
    per_rank = experts.get("per_rank")
    if per_rank:
        busiest = experts["busiest_rank_over_even"]
        lines.append(f"EP={n} expert choices by rank: {per_rank} (busiest / even {busiest})")
    share = all_reduce_share(moe)
    if share is not None:
        lines.append(f"EP={n} all-reduce share of a decode step's kernel time: {share:.1%}")
    pd = load(folder, "disaggregation.json")
    imported, link = dig(pd, "import_gb_per_s"), dig(pd, "pinned_h2d_gb_per_s")
    if imported is not None and link:
        lines.append(
            f"P/D KV handover {imported:.1f} GB/s against a pinned host-to-GPU copy's "
            f"{link:.1f} ({imported / link:.0%})"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--gpus", type=int, required=True)
    args = parser.parse_args()
    for row in rows(args.folder, args.gpus):
        print(row.line())
    for line in notes(args.folder, args.gpus):
        print(line)


if __name__ == "__main__":
    main()
