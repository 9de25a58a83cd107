"""The `kvflow` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from services.launcher.bench import add_bench_parser
from shared.config import Config, ConfigError, add_config_flags, config_from_args
from shared.protocol import ParameterError, SamplingParams

ENGINE_GROUPS = ("model", "cache", "scheduler", "device")
ALL_GROUPS = (*ENGINE_GROUPS, "server", "components")
COMPONENTS = {
    "frontend": "The HTTP API process (FastAPI on uvicorn).",
    "tokenizer": "One tokenizer worker (tokenize in, detokenize out).",
    "scheduler": "The scheduler process (batching, KV blocks, prefix cache).",
    "executor": "One executor process (the model on one device).",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvflow", description="kvflow: an OpenAI-compatible LLM serving engine."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = commands.add_parser(
        "generate",
        help="Generate offline for the given prompts (one batch, one process).",
        description="Generate completions offline. With no MODEL, runs the embedded "
        "SmolLM2-135M-Instruct.",
    )
    model_doc = Config.__dataclass_fields__["model"].metadata["doc"]
    generate.add_argument("model", nargs="?", help=model_doc)
    _add_sampling_flags(generate)
    add_config_flags(generate, ENGINE_GROUPS)
    serve = commands.add_parser(
        "serve",
        help="Serve the OpenAI API: every process on this machine.",
        description="Start the frontend, tokenizer pool, scheduler and executor, and serve "
        "the OpenAI API. With no MODEL, serves the embedded SmolLM2-135M-Instruct.",
    )
    serve.add_argument("model", nargs="?", help=model_doc)
    add_config_flags(serve, ALL_GROUPS)
    add_bench_parser(commands, lambda parser: add_config_flags(parser, ENGINE_GROUPS))
    for name, doc in COMPONENTS.items():
        component = commands.add_parser(
            name, help=f"{doc} Alone, with --frontend-address/--scheduler-address.", description=doc
        )
        component.add_argument("model", nargs="?", help=model_doc)
        add_config_flags(component, ALL_GROUPS)
    return parser


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("generation options")
    group.add_argument("--prompt", action="append", required=True, help="A prompt; repeatable.")
    group.add_argument(
        "--chat",
        action="store_true",
        help="Wrap each prompt as a user message through the model's chat template.",
    )
    group.add_argument("--json", action="store_true", help="Print one JSON object per prompt.")
    group.add_argument(
        "--max-tokens", type=int, default=64, help="Tokens to generate (default 64)."
    )
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default).")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--ignore-eos", action="store_true", help="Keep generating past EOS.")
    group.add_argument("--stop", action="append", default=[], help="A stop string; repeatable.")


def _generate(args: argparse.Namespace) -> int:
    from services.launcher.llm import LLM  # imports torch: only when needed

    config = config_from_args(args)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=config.seed,  # --seed: the same output every run, whatever the batch
        ignore_eos=args.ignore_eos,
        stop=args.stop,
    )
    params.validate()
    llm = LLM(**{k: getattr(config, k) for k in Config.__dataclass_fields__})
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        results = llm.chat(conversations, params, show_progress=True)
    else:
        results = llm.generate(args.prompt, params, show_progress=True)
    for prompt, result in zip(args.prompt, results, strict=True):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": result.text,
                        "token_ids": result.token_ids,
                        "finish_reason": result.finish_reason,
                    },
                    ensure_ascii=False,
                )
            )
        else:
            print(f"--- {prompt!r} [{result.finish_reason}]\n{result.text}")
    return 0


def _run_component(command: str, config: Config) -> int:
    logging.getLogger().handlers[0].setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s [{command}] %(name)s: %(message)s")
    )
    if command == "serve":
        from services.launcher.serve import Launcher

        return Launcher(config).run()
    if command == "frontend":
        from services.frontend.process import run_frontend

        run_frontend(config)
    elif command == "scheduler":
        from services.scheduler.process import SchedulerProcess

        SchedulerProcess(config).run()
    elif command == "executor":
        from services.executor.process import run_executor

        run_executor(config)
    elif command == "tokenizer":
        from services.tokenizer.process import run_tokenizer

        run_tokenizer(config)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", None) or "info"
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "bench":
            from services.launcher.bench import run_bench

            return run_bench(args)
        return _run_component(args.command, config_from_args(args))
    except (ConfigError, ParameterError, FileNotFoundError, ValueError) as exc:
        print(f"kvflow: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
