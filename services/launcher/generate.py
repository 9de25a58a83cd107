"""`kvflow generate`: offline generation for prompts given on the command line."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from typing import Any

from shared.config import (
    OFFLINE_DEFAULTS,
    Config,
    add_config_flags,
    config_from_args,
    field_doc,
    option,
    options_from_args,
)
from shared.protocol import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateOptions:
    """Sampling flags of `kvflow generate` (the server takes these per request instead)."""

    max_tokens: int = option(64, "generation", "Tokens to generate per prompt.")
    temperature: float = option(0.0, "generation", "Sampling temperature; 0 is greedy.")
    top_p: float = option(1.0, "generation", "Sample from the smallest set of this much mass.")
    top_k: int | None = option(None, "generation", "Sample from the k most likely tokens.")
    min_p: float = option(
        0.0, "generation", "Drop tokens less likely than min_p x the most likely one."
    )
    ignore_eos: bool = option(False, "generation", "Keep generating past the EOS token.")


def add_generate_parser(commands: Any, engine_groups: tuple[str, ...]) -> None:
    parser = commands.add_parser(
        "generate",
        help="Generate offline for the given prompts (one batch, one process).",
        description="Generate completions offline. With no MODEL, runs the embedded "
        "SmolLM2-135M-Instruct. Each generation and engine option also reads KVFLOW_<NAME> "
        "from the environment (KVFLOW_TEMPERATURE, KVFLOW_MAX_MODEL_LEN, ...).",
    )
    parser.add_argument("model", nargs="?", help=field_doc("model"))
    group = parser.add_argument_group("prompts")
    group.add_argument("--prompt", action="append", required=True, help="A prompt; repeatable.")
    group.add_argument(
        "--chat",
        action="store_true",
        help="Wrap each prompt as a user message through the model's chat template.",
    )
    group.add_argument("--stop", action="append", default=[], help="A stop string; repeatable.")
    group.add_argument("--json", action="store_true", help="Print one JSON object per prompt.")
    add_config_flags(parser, ("generation",), GenerateOptions)
    add_config_flags(parser, engine_groups)


def run_generate(args: argparse.Namespace) -> int:
    config = config_from_args(args, defaults=OFFLINE_DEFAULTS)
    logger.info("non-default args: %s", config.non_default_summary())
    options = options_from_args(GenerateOptions, args)
    params = SamplingParams(
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        min_p=options.min_p,
        max_tokens=options.max_tokens,
        seed=config.seed,  # --seed: the same output every run, whatever the batch
        ignore_eos=options.ignore_eos,
        stop=args.stop,
    )
    params.validate()
    # torch comes with it: imported once the flags are known to be good (a bad one fails fast)
    from kvflow import LLM

    llm = LLM(**{k: getattr(config, k) for k in Config.__dataclass_fields__})
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        results = llm.chat(conversations, params, show_progress=True)
    else:
        results = llm.generate(args.prompt, params, show_progress=True)
    for prompt, result in zip(args.prompt, results, strict=True):
        if args.json:
            record = {
                "prompt": prompt,
                "text": result.text,
                "token_ids": result.token_ids,
                "finish_reason": result.finish_reason,
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"--- {prompt!r} [{result.finish_reason}]\n{result.text}")
    return 0
