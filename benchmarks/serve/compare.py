"""Latency CDFs of several servers at one request rate, from `kvflow bench serve` JSON files
written with --save-detailed (e.g. kvflow's and vLLM's from the same machine):

    python -m benchmarks.serve.compare --rate 16 kvflow=kvflow.json vllm=vllm.json --out cdf.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.serve.client import RequestResult
from benchmarks.serve.plots import latency_cdfs
from benchmarks.serve.runner import Run


def run_at(report: dict[str, Any], rate: str) -> Run:
    """The run of `report` at `rate` ("16", "inf"), rebuilt from its per-request records."""
    for entry in report["runs"]:
        if str(entry["request_rate"]).removesuffix(".0") == rate:
            if "requests" not in entry:
                raise SystemExit("the JSON has no per-request records: use --save-detailed")
            results = []
            for record in entry["requests"]:
                record = dict(record)
                send_time = record.pop("send_time")
                results.append(RequestResult(**{**record, "start": send_time}))
            return Run(float(rate), results, 0.0, entry["duration_s"], [], "")
    raise SystemExit(f"no run at rate {rate}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", metavar="LABEL=FILE")
    parser.add_argument("--rate", default="16", help="The run's request rate, or inf.")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    labels, runs = [], []
    for item in args.files:
        label, _, path = item.partition("=")
        labels.append(f"{label}, {args.rate} req/s")
        runs.append(run_at(json.loads(Path(path).read_text()), args.rate))
    latency_cdfs(runs, args.out, labels)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
