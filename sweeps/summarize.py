"""Print the device run's table: each figure against its floor, its target and the peer.

    python -m sweeps.summarize $OUT     # reads the JSON files scripts/device_bench.sh wrote

Floors use the ceilings measured in the same run (floors.json): a decode step cannot beat
reading every weight once at the copy bandwidth; a whole offline run cannot beat its matmul
FLOPs (2 x parameters x tokens) at the measured bf16 rate.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def load(folder: Path, name: str) -> dict[str, Any]:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def rows(folder: Path) -> list[tuple[str, str, str, str]]:
    floors = load(folder, "floors")
    copy_gbs = floors.get("copy_gb_per_s")
    tflops = floors.get("bf16_matmul_tflops")
    out = [
        ("copy bandwidth", f"{copy_gbs} GB/s", "", ""),
        ("bf16 matmul", f"{tflops} TFLOP/s", "", ""),
    ]
    out += attention_rows(load(folder, "attention"))
    latency = load(folder, "latency")
    peer = load(folder, "peer_transformers")
    for row in latency.get("results", []):
        floor = ""
        # a step's bytes: per row (a mixture of experts reads more experts at larger batches)
        weight_bytes = row.get("weight_bytes_per_step", latency.get("weight_bytes_per_step"))
        if weight_bytes and copy_gbs and row["batch_size"] == 1:
            floor = f"floor {weight_bytes / (copy_gbs * 1e9) * 1e3:.2f} ms"
        peer_itl = peer.get("latency", {}).get("itl_ms") if row["batch_size"] == 1 else None
        out.append(
            (
                f"decode ITL, batch {row['batch_size']}",
                f"{row['itl_ms_median']} ms",
                floor + ("; target <= 6.0 ms" if row["batch_size"] == 1 else ""),
                f"transformers {peer_itl} ms" if peer_itl else "",
            )
        )
    out += throughput_rows(load(folder, "throughput"), peer, floors, "offline")
    out += throughput_rows(load(folder, "throughput_2048"), peer, floors, "offline, budget 2048")
    out += throughput_rows(load(folder, "small"), {}, floors, "small")
    return out


def attention_rows(attention: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    out = []
    for row in attention.get("results", []):
        target = "target >= 80 %" if (row["batch_size"], row["context_len"]) == (64, 4096) else ""
        reference = f"reference {row['reference_us']} us" if "reference_us" in row else ""
        out.append(
            (
                f"attn decode b{row['batch_size']} ctx{row['context_len']}",
                f"{row['gb_per_s']} GB/s ({100 * row['fraction_of_copy']:.0f} % of copy)",
                target,
                reference,
            )
        )
    return out


def throughput_rows(
    run: dict[str, Any], peer: dict[str, Any], floors: dict[str, Any], name: str
) -> list[tuple[str, str, str, str]]:
    if not run:
        return []
    floor = ""
    tflops, params = floors.get("bf16_matmul_tflops"), run.get("matmul_parameters")
    if tflops and params and "total_tokens" in run:
        seconds = 2 * params * run["total_tokens"] / (tflops * 1e12)
        floor = f"floor {run['output_tokens'] / seconds:,.0f} tok/s (matmul)"
    target = "; target >= 8,000" if name.startswith("offline") else ""
    peers = []
    for mode in ("continuous", "static"):
        rate = peer.get(mode, {}).get("output_tok_per_s")
        if rate:
            peers.append(f"{mode} {rate:,.0f} ({run['output_tok_per_s'] / rate:.1f}x)")
    busy = run.get("gpu_busy_fraction")
    label = f"{name} output tok/s" + (f" (GPU busy {100 * busy:.0f} %)" if busy else "")
    return [(label, f"{run['output_tok_per_s']:,.0f}", floor + target, ", ".join(peers))]


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    table = rows(folder)
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    header = ("figure", "measured", "floor / target", "peer")
    for line in [header, *table]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))


if __name__ == "__main__":
    main()
