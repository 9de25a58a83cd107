"""sweeps/multi_gpu_summary.py reads the benchmarks' own result files (real ones from
docs/results here, under the names scripts/device_multi_gpu.sh gives them) into issue 51's
ratios, and marks what did not run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from sweeps.multi_gpu_summary import all_reduce_share, notes, rows, served_tok_s

RESULTS = Path(__file__).parents[2] / "docs" / "results"
GEMMA = RESULTS / "2026-12-05-h100-gemma3-same-run"
AS_NAMED = {
    "latency.json": GEMMA / "latency_kvflow_n8_tiles.json",  # batch 1: 9.563 ms
    "latency_tp2.json": GEMMA / "latency_kvflow_3e79569.json",  # 9.267 ms
    "Llama-3.1-8B_vllm_tp2.json": GEMMA / "vllm_gemma-3-12b.json",  # 10.544 ms
    "dp1_load.json": RESULTS / "2026-11-24-h100-offline-serve-overlap/lease2/kvflow_load.json",
    "dp1_load_again.json": RESULTS / "2026-11-24-h100-offline-serve-overlap/lease2/vllm_load.json",
    "dp2_load.json": RESULTS / "2026-11-24-h100-offline-serve-overlap/lease2/kvflow_load.json",
    "disaggregation.json": RESULTS / "2026-12-04-h200-disaggregation/disaggregation.json",
}

DP1_LOADS = ("dp1_load.json", "dp1_load_again.json")


def test_the_ratios_come_from_the_result_files_and_missing_ones_are_not_run(
    tmp_path: Path,
) -> None:
    for name, source in AS_NAMED.items():
        shutil.copy(source, tmp_path / name)
    by_measure = {row.measure: row for row in rows(tmp_path, 2)}
    tp = by_measure["TP=2 / TP=1 batch-1 ITL, Llama-3.1-8B"]
    assert (tp.ours, tp.base, tp.met) == (9.267, 9.563, False)  # 0.969 > 0.6
    vllm = by_measure["kvflow / vLLM batch-1 ITL at TP=2"]
    assert vllm.ratio is not None and round(vllm.ratio, 3) == 0.879 and vllm.met
    serve = by_measure["DP=2 / DP=1 serve output tok/s, mean of the loads"]
    kvflow, peer = (served_tok_s(json.loads(AS_NAMED[f].read_text())) for f in DP1_LOADS)
    assert serve.ours == kvflow and serve.base == (kvflow + peer) / 2  # the mean of the two
    assert serve.target == ">= 1.85" and serve.met is False
    tpot = by_measure["P/D pair / DP pair decode TPOT p99"]
    assert tpot.ratio is not None and round(tpot.ratio, 3) == round(8.497183 / 8.711006, 3)
    assert by_measure["TP=2 / TP=1 offline tok/s"].line().endswith("not run")
    lines = notes(tmp_path, 2)
    assert lines == ["P/D KV handover 16.3 GB/s against a pinned host-to-GPU copy's 52.6 (31%)"]


def test_the_all_reduce_share_counts_nccl_and_the_fused_kernel() -> None:
    profile = {
        "kernel_ms_per_step": 10.0,
        "top_kernels_ms_per_step": {
            "_skinny_linear_kernel": 7.0,
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": 1.0,
            "_fused_all_reduce_rms_norm_kernel": 0.5,
        },
    }
    assert all_reduce_share({"decode_profile": profile}) == 0.15
    assert all_reduce_share(json.loads("{}")) is None
