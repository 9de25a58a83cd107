"""`kvflow bench serve`'s flags: vLLM's `bench serve` names, defaults and meanings.

A command line copied from `vllm bench serve` runs as it is, and `--save-result` writes vLLM's
result file. What kvflow cannot do is refused by name (`--profile`, `--ramp-up-strategy`, ...),
and a flag given where it would have no effect (a dataset's flag for another dataset,
`--result-dir` without `--save-result`) is refused too, by checks.py: no flag is accepted and
ignored.
Where kvflow differs from vLLM it says so in the flag's help (`--num-warmups` defaults to 1;
`--request-rate` also takes a comma list; the percentiles of all four metrics by default).

Free of aiohttp and matplotlib: the `kvflow` command builds this parser on every start.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
METRICS = ("ttft", "tpot", "itl", "e2el")
EMBEDDING_METRICS = ("e2el",)  # an embedding request has no tokens out: only its latency
# vLLM's backends that speak the OpenAI API, and the endpoint each needs (None: either
# generating endpoint).
BACKENDS = {"openai": None, "vllm": None, "openai-chat": CHAT, "openai-embeddings": EMBEDDINGS}
# The sampling fields a flag of the same name sends (when given), and their types.
SAMPLING: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "frequency_penalty": float,
    "presence_penalty": float,
    "repetition_penalty": float,
}
DATASETS = ("random", "prefix-repetition", "sharegpt")
DATASET_ALIASES = {"prefix_repetition": "prefix-repetition"}  # vLLM's spelling
# Each dataset's own flags, with their defaults (vLLM's). Given for another dataset they are
# refused, so their parser defaults are None and the defaults are filled in after parsing.
DATASET_FLAGS: dict[str, dict[str, Any]] = {
    "random": {
        "random_input_len": 1024,
        "random_output_len": 128,
        "random_range_ratio": 0.0,
        "random_prefix_len": 0,
        "random_batch_size": 1,
    },
    "prefix-repetition": {
        "prefix_repetition_prefix_len": 256,
        "prefix_repetition_suffix_len": 256,
        "prefix_repetition_num_prefixes": 10,
        "prefix_repetition_output_len": 128,
    },
    "sharegpt": {
        "dataset_path": None,
        "sharegpt_output_len": None,
        "disable_shuffle": False,
        "no_oversample": False,
    },
}
# --input-len / --output-len (vLLM's general lengths) and the flag each stands for.
GENERAL_LENGTHS = {
    "input_len": {"random": "random_input_len"},
    "output_len": {
        "random": "random_output_len",
        "prefix-repetition": "prefix_repetition_output_len",
        "sharegpt": "sharegpt_output_len",
    },
}
# Flags of `vllm bench serve` that kvflow refuses, and why.
REFUSED = {
    "--profile": "kvflow serve has no /start_profile endpoint",
    "--use-beam-search": "kvflow does not do beam search",
    "--logprobs": "not implemented: the requests ask for no logprobs",
    "--ramp-up-strategy": "ramped rates are not implemented; --request-rate takes a comma list"
    " of rates run in turn",
    "--ramp-up-start-rps": "ramped rates are not implemented (see --request-rate)",
    "--ramp-up-end-rps": "ramped rates are not implemented (see --request-rate)",
    "--ready-check-timeout-sec": "not implemented: start the benchmark once the server is ready",
    "--lora-modules": "not implemented; one adapter: --served-model-name ADAPTER",
    "--lora-assignment": "not implemented (see --lora-modules)",
    "--request-id-prefix": "the requests carry no request ids",
    "--plot-timeline": "not implemented; --plot DIR draws PNG timelines and CDFs",
    "--timeline-itl-thresholds": "not implemented (see --plot)",
    "--plot-dataset-stats": "not implemented (see --plot)",
    "--probe-request-rate": "probe requests are not implemented",
    "--self-timed": "timed traces are not implemented",
    "--no-self-timed": "timed traces are not implemented",
    "--insecure": "not implemented: TLS certificates are always verified",
    "--chat-template-kwargs": "prompts are never rendered with a chat template on the client",
    "--skip-chat-template": "prompts are never rendered with a chat template on the client",
    "--no-stream": "only local dataset files are read (no streaming datasets)",
    "--no-reranker": "reranking benchmarks are not implemented",
}


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
        if limit < 0:
            raise argparse.ArgumentTypeError(
                f"bad goodput SLO {text!r}: the limit must not be negative"
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


def parse_percentile_metrics(text: str) -> list[str]:
    """`ttft,tpot,itl,e2el` or any of them, in the order given."""
    names = [part.strip() for part in text.split(",")]
    unknown = [name for name in names if name not in METRICS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"kvflow measures no {', '.join(unknown)}: want a comma list of {','.join(METRICS)}"
        )
    return names


def parse_key_value(text: str) -> tuple[str, str]:
    """`KEY=VALUE` (the value may hold more `=`), as vLLM's --metadata and --header take."""
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(f"bad pair {text!r}: want KEY=VALUE")
    return key.strip(), value.strip()


def percentile_key(p: float) -> str:
    """How vLLM writes a percentile in its keys and table: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


class _Refused(argparse.Action):
    """A vLLM flag kvflow cannot honour: parsing stops with the flag's name and the reason."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.reason: str = kwargs.pop("reason")
        kwargs.update(nargs="*", default=argparse.SUPPRESS, metavar="VALUE")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.error(f"{option_string} (a vllm bench serve flag) is not supported: {self.reason}")


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's `bench serve` flags, then kvflow's own, then the vLLM flags kvflow refuses."""
    _server_flags(parser.add_argument_group("server"))
    _dataset_flags(parser.add_argument_group("dataset"))
    _load_flags(parser.add_argument_group("load and sampling"))
    _report_flags(parser.add_argument_group("report"))
    _result_file_flags(parser.add_argument_group("result file (vLLM's)"))
    refused = parser.add_argument_group("vllm bench serve flags kvflow refuses")
    for flag, reason in REFUSED.items():
        refused.add_argument(flag, action=_Refused, reason=reason, help=reason)


def _server_flags(where: argparse._ArgumentGroup) -> None:
    where.add_argument("--base-url", help="e.g. http://127.0.0.1:8000 (else --host/--port)")
    where.add_argument("--host", default="127.0.0.1")
    where.add_argument("--port", type=int, default=8000)
    where.add_argument("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT, EMBEDDINGS])
    where.add_argument(
        "--backend",
        default="openai",
        choices=list(BACKENDS),
        help="vLLM's name for the API spoken: openai and vllm (either generating endpoint),"
        " openai-chat (needs --endpoint /v1/chat/completions), openai-embeddings (needs"
        " --endpoint /v1/embeddings); the result file's default label.",
    )
    where.add_argument(
        "--model",
        help="The model's id: the result file's name and model_id, and the name requested"
        " unless --served-model-name (default: the first model the server lists).",
    )
    where.add_argument("--served-model-name", help="The model name sent in the requests.")
    where.add_argument("--api-key", help="Bearer key (default: $OPENAI_API_KEY, if set).")
    where.add_argument(
        "--header",
        type=parse_key_value,
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="More HTTP headers for every request.",
    )


def _dataset_flags(data: argparse._ArgumentGroup) -> None:
    data.add_argument(
        "--dataset-name",
        default="random",
        choices=[*DATASETS, *DATASET_ALIASES],
        help="random token ids; prefix-repetition (or vLLM's prefix_repetition): shared"
        " prefixes; sharegpt: a ShareGPT JSON file (--dataset-path).",
    )
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument(
        "--tokenizer", help="Tokenizer name or folder: vocabulary bound, ShareGPT lengths."
    )
    data.add_argument(
        "--tokenizer-mode",
        choices=["auto", "hf"],
        help="With --tokenizer: both load it with transformers' AutoTokenizer.",
    )
    data.add_argument(
        "--trust-remote-code", action="store_true", help="With --tokenizer: run its code."
    )
    data.add_argument(
        "--skip-tokenizer-init", action="store_true", help="Load no tokenizer (no --tokenizer)."
    )
    data.add_argument("--input-len", type=int, help="Stands for --random-input-len.")
    data.add_argument("--output-len", type=int, help="Stands for the dataset's output length flag.")
    data.add_argument("--random-input-len", type=int, help="Default 1024.")
    data.add_argument("--random-output-len", type=int, help="Default 128.")
    data.add_argument(
        "--random-range-ratio",
        type=float,
        help="Lengths uniform in [len * (1 - r), len * (1 + r)]; default 0.",
    )
    data.add_argument(
        "--random-prefix-len", type=int, help="A random prefix every prompt shares; default 0."
    )
    data.add_argument(
        "--random-batch-size",
        type=int,
        help="Prompts per request, for --backend openai-embeddings (whose inputs are lists);"
        " --num-prompts counts prompts; default 1.",
    )
    data.add_argument("--prefix-repetition-prefix-len", type=int, help="Default 256.")
    data.add_argument("--prefix-repetition-suffix-len", type=int, help="Default 256.")
    data.add_argument("--prefix-repetition-num-prefixes", type=int, help="Default 10.")
    data.add_argument("--prefix-repetition-output-len", type=int, help="Default 128.")
    data.add_argument("--dataset-path", type=Path, help="A ShareGPT-format JSON file.")
    data.add_argument(
        "--sharegpt-output-len", type=int, help="Fixed max_tokens instead of the reply's length."
    )
    data.add_argument(
        "--disable-shuffle", action="store_true", help="ShareGPT conversations in file order."
    )
    data.add_argument(
        "--no-oversample",
        action="store_true",
        help="Fewer requests than --num-prompts if the file has fewer conversations.",
    )


def _load_flags(load: argparse._ArgumentGroup) -> None:
    load.add_argument(
        "--request-rate",
        type=parse_rates,
        default=[math.inf],
        help="Requests per second, Poisson arrivals; inf sends all at once; a comma list "
        "(4,16,inf) runs each in order with fresh prompts (kvflow's).",
    )
    load.add_argument(
        "--burstiness", type=float, help="Gamma shape of the gaps; 1 (the default) = Poisson."
    )
    load.add_argument("--max-concurrency", type=int, help="At most this many requests in flight.")
    load.add_argument(
        "--num-warmups",
        type=int,
        default=1,
        help="Requests sent first, untimed (default 1; vLLM's is 0).",
    )
    load.add_argument("--ignore-eos", action="store_true", help="Always generate max_tokens.")
    load.add_argument("--seed", type=int, default=0)
    for name, kind in SAMPLING.items():
        load.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            help="Sent when given (else the server's default).",
        )
    load.add_argument(
        "--extra-body",
        type=_json_object,
        help="More body fields, as a JSON object: e.g. '{\"response_format\": {...}}'.",
    )


def _report_flags(report: argparse._ArgumentGroup) -> None:
    report.add_argument(
        "--goodput",
        type=Slo.parse,
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="Service level objectives, e.g. ttft:200 tpot:20 e2el:5000.",
    )
    report.add_argument(
        "--percentile-metrics",
        type=parse_percentile_metrics,
        help="Comma list of the metrics reported: ttft,tpot,itl,e2el (all four by default;"
        " vLLM's default leaves e2el out; e2el alone for embeddings).",
    )
    report.add_argument(
        "--metric-percentiles",
        type=parse_percentiles,
        default=[99.0],
        help="Comma list of percentiles reported beside mean and median (default 99).",
    )
    report.add_argument("--output-json", type=Path, help="Write kvflow's whole report here.")
    report.add_argument(
        "--save-detailed",
        action="store_true",
        help="Add every request's timings to the JSON (--output-json, --save-result).",
    )
    report.add_argument("--plot", type=Path, metavar="DIR", help="Write PNG plots into DIR.")
    report.add_argument("--disable-tqdm", action="store_true", help="No progress lines.")


def _result_file_flags(result: argparse._ArgumentGroup) -> None:
    result.add_argument(
        "--save-result",
        action="store_true",
        help="Write vLLM's result file: {label}-{rate}qps[-concurrency{N}]-{model}-{time}.json"
        " (one a rate).",
    )
    result.add_argument(
        "--append-result",
        action="store_true",
        help="Append to the result file instead (a JSON object a line).",
    )
    result.add_argument("--result-dir", type=Path, help="The result file's folder (default .).")
    result.add_argument("--result-filename", help="The result file's name instead.")
    result.add_argument("--label", help="The file name's first part instead of --backend.")
    result.add_argument(
        "--metadata",
        type=parse_key_value,
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="Pairs written into the result file's top level.",
    )


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
