"""Issue 49's table from a `scripts/device_speed.sh` run: batch-1 inter-token latency and
`offline` output tok/s per weight format, kvflow against vLLM 0.26 in the same run, the ratios
and the issue's targets:

    python3 -m sweeps.speed_table RESULTS_DIR [--json OUT.json]

RESULTS_DIR holds `speed_{format}_latency_kvflow.json` (`kvflow bench latency`),
`speed_{format}_offline_kvflow.json` (`kvflow bench throughput`) and `speed_{format}_vllm.json`
(sweeps/engine_vllm.py). A run that is missing shows as "-".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

FORMATS = ("bf16", "fp8", "fp8kv", "int4")
LABELS = {
    "bf16": "bf16",
    "fp8": "FP8 W8A8",
    "fp8kv": "bf16, FP8 KV cache",
    "int4": "int4 AWQ",
}
# What vLLM must report it ran (`quantization_used`) for its row to count: its AWQ kernels
# (0.26 names them auto_awq: Machete on Hopper, Marlin elsewhere), its FP8; bf16 otherwise.
VLLM_QUANTIZATION = {
    "bf16": (None,),
    "fp8": ("fp8",),
    "fp8kv": (None,),
    "int4": ("awq", "awq_marlin", "auto_awq"),
}
# The issue's targets, kvflow / vLLM: batch-1 ITL at most (every format), offline at least.
ITL_TARGET = 0.9
OFFLINE_TARGETS = {"bf16": 1.1, "fp8": 1.15, "fp8kv": 1.1, "int4": 1.0}


def load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def kvflow_itl(report: dict[str, Any] | None) -> float | None:
    if report is None:
        return None
    batch_1 = [r for r in report["results"] if r["batch_size"] == 1]
    return float(batch_1[0]["itl_ms_median"]) if batch_1 else None


def rows(results: Path) -> list[dict[str, Any]]:
    """One row a format: each engine's ITL (ms) and offline (tok/s), and the ratios."""
    table = []
    for fmt in FORMATS:
        latency = load(results / f"speed_{fmt}_latency_kvflow.json")
        offline = load(results / f"speed_{fmt}_offline_kvflow.json")
        vllm = load(results / f"speed_{fmt}_vllm.json")
        if vllm is not None and vllm.get("quantization_used") not in VLLM_QUANTIZATION[fmt]:
            print(f"{fmt}: vLLM ran {vllm.get('quantization_used')!r}, left out")
            vllm = None  # another format's figures: no ratio
        row: dict[str, Any] = {
            "format": fmt,
            "kvflow_itl_ms": kvflow_itl(latency),
            "vllm_itl_ms": vllm["latency"]["itl_ms"] if vllm else None,
            "kvflow_offline": offline["output_tok_per_s"] if offline else None,
            "vllm_offline": vllm["offline"]["output_tok_per_s"] if vllm else None,
            "vllm_quantization": vllm.get("quantization_used") if vllm else None,
        }
        row["itl_ratio"] = ratio(row["kvflow_itl_ms"], row["vllm_itl_ms"])
        row["offline_ratio"] = ratio(row["kvflow_offline"], row["vllm_offline"])
        itl, offline_ratio = row["itl_ratio"], row["offline_ratio"]
        row["itl_met"] = None if itl is None else itl <= ITL_TARGET
        row["offline_met"] = (
            None if offline_ratio is None else offline_ratio >= OFFLINE_TARGETS[fmt]
        )
        table.append(row)
    return table


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or not theirs else round(ours / theirs, 3)


def show(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def render(table: list[dict[str, Any]]) -> str:
    lines = [
        "| format | ITL kvflow / vLLM, ms | ratio (<= 0.9) | offline kvflow / vLLM, tok/s "
        "| ratio (target) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in table:
        target = OFFLINE_TARGETS[r["format"]]
        mark = {True: " met", False: " missed", None: ""}
        lines.append(
            f"| {LABELS[r['format']]} | {show(r['kvflow_itl_ms'], '.2f')} / "
            f"{show(r['vllm_itl_ms'], '.2f')} | {show(r['itl_ratio'], '.3f')}{mark[r['itl_met']]} "
            f"| {show(r['kvflow_offline'], ',.0f')} / {show(r['vllm_offline'], ',.0f')} "
            f"| {show(r['offline_ratio'], '.3f')} (>= {target}){mark[r['offline_met']]} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    table = rows(args.results)
    print(render(table))
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
