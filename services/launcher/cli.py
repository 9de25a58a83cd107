"""The `kvflow` command line: generate, serve, bench, keys, and each component on its own."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from pathlib import Path

from benchmarks.cli import add_bench_parser
from services.launcher.generate import add_generate_parser
from shared.config import (
    OFFLINE_DEFAULTS,
    Config,
    ConfigError,
    add_config_flags,
    config_from_args,
    field_doc,
)
from shared.model_config import resolve_model_source
from shared.pooling import resolve_task
from shared.protocol import ParameterError
from shared.version import VERSION
from shared.wire_security import make_keys

logger = logging.getLogger(__name__)
ENGINE_GROUPS = ("model", "parallel", "lora", "cache", "scheduler", "device")
ALL_GROUPS = (*ENGINE_GROUPS, "server", "limits", "components")
COMPONENTS = {
    "frontend": "The HTTP API process (FastAPI on uvicorn).",
    "tokenizer": "One tokenizer worker (tokenize in, detokenize out).",
    "scheduler": "The scheduler process (batching, KV blocks, prefix cache).",
    "executor": "The executor (the model on its devices: one process per tensor-parallel rank).",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvflow", description="kvflow: an OpenAI-compatible LLM serving engine."
    )
    parser.add_argument("--version", action="version", version=f"kvflow {VERSION}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_parser(commands, ENGINE_GROUPS)
    model_doc = field_doc("model")
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
        # Set by `kvflow serve` for the processes it starts: it has logged the config already.
        component.add_argument("--supervised", action="store_true", help=argparse.SUPPRESS)
    keys = commands.add_parser(
        "keys",
        help="Make the ZeroMQ CURVE keys that --curve-key-dir reads.",
        description="Write a server and a client CURVE key pair into DIR (made 0700 if new;"
        " secret files 0600). Never overwrites keys.",
    )
    keys.add_argument("directory", metavar="DIR", help="The folder for the key files.")
    return parser


def component_config(args: argparse.Namespace) -> Config:
    """The flags' config. An embedding model takes offline's larger steps by default: its
    requests have no decodes that a long step would hold up, and a step's host work (eager
    above the CUDA graphs' sizes) costs the same at 2,048 tokens as at 16,384."""
    config = config_from_args(args)
    if config.task == "generate":
        return config
    try:
        task = resolve_task(config.task, resolve_model_source(config.model))
    except FileNotFoundError:  # a component started without the model's files
        return config
    return config_from_args(args, defaults=OFFLINE_DEFAULTS) if task == "embed" else config


def _run_component(args: argparse.Namespace) -> int:
    command = args.command
    logging.getLogger().handlers[0].setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s [{command}] %(name)s: %(message)s")
    )
    config = component_config(args)
    if command == "serve":
        from services.launcher.serve import Launcher

        launcher = Launcher(config)  # picks the private addresses its processes use
        logger.info("non-default args: %s", launcher.config.non_default_summary())
        return launcher.run()
    if not args.supervised:
        logger.info("non-default args: %s", config.non_default_summary())
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
        from services.tokenizer.process import TokenizerProcess

        TokenizerProcess(config).run()
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
            from services.launcher.generate import run_generate

            return run_generate(args)
        if args.command == "bench":
            from benchmarks.cli import run_bench

            return run_bench(args)
        if args.command == "keys":
            print("\n".join(str(path) for path in make_keys(Path(args.directory))))
            return 0
        return _run_component(args)
    except (ConfigError, ParameterError, FileNotFoundError) as exc:
        print(f"kvflow: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a model kvflow cannot load, or a fault: keep where it came from
        traceback.print_exc()
        print(f"kvflow: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
