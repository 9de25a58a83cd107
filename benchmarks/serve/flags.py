"""`kvflow bench serve`'s flags, vLLM's `bench serve` names where the two overlap.

Free of aiohttp and matplotlib: the `kvflow` command builds this parser on every start.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Slo:
    """A goodput objective: `metric` (ttft, tpot or e2el) at most `limit_ms` milliseconds."""

    metric: str
    limit_ms: float

    @classmethod
    def parse(cls, text: str) -> Slo:
        metric, _, value = text.partition(":")
        if metric not in ("ttft", "tpot", "e2el") or not value:
            raise argparse.ArgumentTypeError(
                f"bad goodput SLO {text!r}: want ttft:MS, tpot:MS or e2el:MS"
            )
        limit = float(value)
        if limit <= 0:
            raise argparse.ArgumentTypeError(
                f"bad goodput SLO {text!r}: the limit must be positive"
            )
        return cls(metric, limit)


def parse_rates(text: str) -> list[float]:
    """`16`, `inf`, or a comma list `4,16,inf` run in order."""
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad request rate {text!r}") from None
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be positive, got {text!r}")
    return rates


def parse_percentiles(text: str) -> list[float]:
    """`50,90,99`: each in [0, 100]."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad percentiles {text!r}") from None
    if not all(0 <= p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in [0, 100], got {text!r}")
    return values


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's `bench serve` flag names where the two overlap."""
    where = parser.add_argument_group("server")
    where.add_argument("--base-url", help="e.g. http://127.0.0.1:8000 (else --host/--port)")
    where.add_argument("--host", default="127.0.0.1")
    where.add_argument("--port", type=int, default=8000)
    where.add_argument(
        "--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"]
    )
    where.add_argument("--model", help="Model name to request (default: the first listed).")
    where.add_argument("--api-key", help="Bearer key (default: $OPENAI_API_KEY, if set).")
    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name", default="random", choices=["random", "prefix-repetition", "sharegpt"]
    )
    data.add_argument("--dataset-path", type=Path, help="A ShareGPT-format JSON file.")
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument(
        "--tokenizer", help="Tokenizer name or folder: vocabulary bound, ShareGPT lengths."
    )
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="Lengths uniform in [len * (1 - r), len * (1 + r)].",
    )
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)
    data.add_argument(
        "--sharegpt-output-len", type=int, help="Fixed max_tokens instead of the reply's length."
    )
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=parse_rates,
        default=[math.inf],
        help="Requests per second, Poisson arrivals; inf sends all at once; a comma list "
        "(4,16,inf) runs each in order with fresh prompts.",
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="Gamma shape of the gaps; 1 = Poisson."
    )
    load.add_argument("--max-concurrency", type=int, help="At most this many requests in flight.")
    load.add_argument("--num-warmups", type=int, default=1, help="Requests sent first, untimed.")
    load.add_argument("--ignore-eos", action="store_true", help="Always generate max_tokens.")
    load.add_argument("--temperature", type=float, help="Sent when given (server default else).")
    load.add_argument("--top-p", type=float)
    load.add_argument("--top-k", type=int)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument(
        "--extra-body",
        type=_json_object,
        help="More body fields, as a JSON object: e.g. '{\"response_format\": {...}}'.",
    )
    report = parser.add_argument_group("report")
    report.add_argument(
        "--goodput",
        type=Slo.parse,
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="Service level objectives, e.g. ttft:200 tpot:20 e2el:5000.",
    )
    report.add_argument(
        "--metric-percentiles",
        type=parse_percentiles,
        default=[99.0],
        help="Comma list of percentiles reported beside mean and median (default 99).",
    )
    report.add_argument("--output-json", type=Path, help="Write every figure here.")
    report.add_argument(
        "--save-detailed", action="store_true", help="Add every request's timings to the JSON."
    )
    report.add_argument("--plot", type=Path, metavar="DIR", help="Write PNG plots into DIR.")
    report.add_argument("--disable-tqdm", action="store_true", help="No progress lines.")


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
