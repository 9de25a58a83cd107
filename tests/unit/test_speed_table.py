"""sweeps/speed_table.py reads the benchmarks' own result files (real ones from docs/results,
under the names scripts/device_speed.sh gives them) into issue 49's ratios and targets, and
marks what did not run."""

from __future__ import annotations

import shutil
from pathlib import Path

from sweeps.speed_table import render, rows

GEMMA = Path(__file__).parents[2] / "docs" / "results" / "2026-12-05-h200-gemma3-vs-vllm"
AS_NAMED = {  # kvflow 7.46 ms and 5,276.1 tok/s; vLLM 8.214 ms and 4,942.0 tok/s
    "speed_bf16_latency_kvflow.json": GEMMA / "latency_kvflow_1.json",
    "speed_bf16_offline_kvflow.json": GEMMA / "offline_kvflow.json",
    "speed_bf16_vllm.json": GEMMA / "vllm_1.json",
    "speed_int4_offline_kvflow.json": GEMMA / "offline_kvflow.json",
    "speed_int4_vllm.json": GEMMA / "vllm_1.json",  # vLLM ran bf16 there: no int4 peer
}


def test_the_ratios_come_from_the_result_files_and_missing_ones_are_not_run(
    tmp_path: Path,
) -> None:
    for name, source in AS_NAMED.items():
        shutil.copy(source, tmp_path / name)
    by_format = {row["format"]: row for row in rows(tmp_path)}
    bf16 = by_format["bf16"]
    assert (bf16["kvflow_itl_ms"], bf16["vllm_itl_ms"]) == (7.46, 8.214)
    assert bf16["itl_ratio"] == 0.908 and not bf16["itl_met"]  # over 0.9
    assert bf16["offline_ratio"] == 1.068 and not bf16["offline_met"]  # under 1.1
    int4 = by_format["int4"]  # kvflow's offline alone (vLLM's run was not int4): no ratio
    assert int4["kvflow_offline"] == 5276.1 and int4["vllm_offline"] is None
    assert int4["offline_ratio"] is None
    assert int4["offline_met"] is None and int4["kvflow_itl_ms"] is None
    table = render(list(by_format.values()))
    assert "| bf16 | 7.46 / 8.21 | 0.908 missed | 5,276 / 4,942 | 1.068 (>= 1.1) missed |" in table
    assert "| int4 AWQ | - / - | - | 5,276 / - | - (>= 1.0) |" in table
