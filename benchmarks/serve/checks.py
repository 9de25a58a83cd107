"""`kvflow bench serve`'s command line checked once parsed: what would have no effect or cannot
be honoured is refused with the reason (`check_serve_args`), and the chosen dataset's defaults
are filled in. The flags themselves are flags.py's."""

from __future__ import annotations

import argparse
import math

from benchmarks.serve.flags import (
    BACKENDS,
    CHAT,
    DATASET_ALIASES,
    DATASET_FLAGS,
    EMBEDDING_METRICS,
    EMBEDDINGS,
    GENERAL_LENGTHS,
    METRICS,
    SAMPLING,
)

# What means nothing to an embedding request, by dest: refused with --backend openai-embeddings.
GENERATION_ONLY = (
    "ignore_eos",
    "output_len",
    "random_output_len",
    "prefix_repetition_output_len",
    "sharegpt_output_len",
    *SAMPLING,
)


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse what would have no effect or cannot be honoured, then fill in the dataset's
    defaults; raises SystemExit with the reason."""
    args.dataset_name = DATASET_ALIASES.get(args.dataset_name, args.dataset_name)
    problem = (
        _dataset_problem(args)
        or _tokenizer_problem(args)
        or _load_problem(args)
        or _embedding_problem(args)
        or _result_file_problem(args)
    )
    if problem:
        raise SystemExit(f"kvflow bench serve: {problem}")
    for name, default in DATASET_FLAGS[args.dataset_name].items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _given(args: argparse.Namespace, name: str) -> bool:
    value = getattr(args, name)
    return value is not None and value is not False


def _dataset_problem(args: argparse.Namespace) -> str | None:
    chosen = args.dataset_name
    for dataset, flags in DATASET_FLAGS.items():
        for name in flags:
            if dataset != chosen and _given(args, name):
                return f"{_flag(name)} is a {dataset} dataset flag; this run's is {chosen}"
    for general, stands_for in GENERAL_LENGTHS.items():
        if getattr(args, general) is None:
            continue
        specific = stands_for.get(chosen)
        if specific is None:
            return f"{_flag(general)} has no meaning for --dataset-name {chosen}"
        if getattr(args, specific) is not None:
            return f"give {_flag(general)} or {_flag(specific)}, not both"
        setattr(args, specific, getattr(args, general))
        setattr(args, general, None)  # said once, by the flag it stands for
    if chosen == "sharegpt" and args.dataset_path is None:
        return "--dataset-name sharegpt needs --dataset-path FILE.json"
    if args.endpoint == CHAT and chosen != "sharegpt":
        return f"{CHAT} needs text prompts: --dataset-name sharegpt"
    return None


def _tokenizer_problem(args: argparse.Namespace) -> str | None:
    if args.tokenizer is None:
        for name in ("tokenizer_mode", "trust_remote_code"):
            if _given(args, name):
                return f"{_flag(name)} needs --tokenizer"
    elif args.skip_tokenizer_init:
        return "--skip-tokenizer-init and --tokenizer contradict each other"
    return None


def _load_problem(args: argparse.Namespace) -> str | None:
    needed = BACKENDS[args.backend]
    if needed is not None and args.endpoint != needed:
        return f"--backend {args.backend} needs --endpoint {needed}"
    if args.endpoint == EMBEDDINGS and needed != EMBEDDINGS:
        return f"--endpoint {EMBEDDINGS} needs --backend openai-embeddings"
    if args.burstiness is None:
        args.burstiness = 1.0
    elif args.burstiness != 1.0 and all(math.isinf(rate) for rate in args.request_rate):
        return "--burstiness shapes the gaps of a finite --request-rate; every rate here is inf"
    if args.burstiness <= 0:
        return "--burstiness must be positive"
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        return "--max-concurrency must be positive"
    return None


def _embedding_problem(args: argparse.Namespace) -> str | None:
    """An embedding run has no output: what shapes or measures one is refused; the metrics
    default to the one it has."""
    embedding = args.endpoint == EMBEDDINGS
    if args.percentile_metrics is None:
        args.percentile_metrics = list(EMBEDDING_METRICS if embedding else METRICS)
    if not embedding:
        if args.random_batch_size not in (None, 1):
            return "--random-batch-size batches embedding inputs: --backend openai-embeddings"
        return None
    for name in GENERATION_ONLY:
        if _given(args, name):
            return f"{_flag(name)} shapes generated tokens; an embedding request has none"
    measured = set(args.percentile_metrics) | {slo.metric for slo in args.goodput}
    if not_measured := sorted(measured - set(EMBEDDING_METRICS)):
        return f"an embedding request has no tokens out: {','.join(not_measured)} is not measured"
    if args.random_batch_size is not None and args.random_batch_size < 1:
        return "--random-batch-size must be at least 1"
    return None


def _result_file_problem(args: argparse.Namespace) -> str | None:
    saving = args.save_result or args.append_result
    if not saving:
        for name in ("result_dir", "result_filename", "label", "metadata"):
            if getattr(args, name):
                return f"{_flag(name)} names or fills the result file: add --save-result"
        if args.save_detailed and args.output_json is None:
            return "--save-detailed needs --save-result or --output-json"
    if args.result_filename and len(args.request_rate) > 1 and not args.append_result:
        return (
            "--result-filename names one file and each --request-rate writes a result:"
            " add --append-result, or leave the names to kvflow"
        )
    return None
