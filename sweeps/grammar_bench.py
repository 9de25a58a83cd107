"""What structured output costs on the host: the 20-field JSON Schema the device benchmark asks
for, its check in the tokenizer pool (cold and cached), a matcher's start, and the per-step
bitmask of a batch of matchers walking a valid document, token by token.

    python -m sweeps.grammar_bench TOKENIZER_DIR --out grammar.json
    python -m sweeps.grammar_bench --extra-body extra.json   # the serve benchmark's body
    python -m sweeps.grammar_bench --check http://127.0.0.1:8100 --out check.json

`--check` asks a running server (kvflow or vLLM) for 16 sampled answers under the schema and
counts those that finished and those that validate.

Writes JSON; times are medians of repeats, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

import llguidance.torch
import torch
from llguidance import LLExecutor, LLMatcher

from shared.config import Config
from shared.grammar import GrammarChecker, grammar_of, llg_tokenizer, parser_limits
from shared.hf_tokenizer import load_tokenizer
from shared.model_config import ModelSource
from shared.protocol import StructuredOutput

_TEXT = {"type": "string", "maxLength": 40}
SCHEMA_20: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": _TEXT,
        "email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z0-9]{1,20}\\.[a-z]{2,4}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer", "guest"]},
        "tags": {"type": "array", "items": _TEXT, "maxItems": 4},
        "city": _TEXT,
        "country": _TEXT,
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "phone": {"type": "string", "pattern": "^\\+?[0-9 ]{7,15}$"},
        "created": {"type": "string", "format": "date"},
        "notes": {"type": ["string", "null"], "maxLength": 80},
        "rating": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
        "manager": {
            "type": "object",
            "properties": {"name": _TEXT, "id": {"type": "integer"}},
            "required": ["name", "id"],
            "additionalProperties": False,
        },
        "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "de"]}},
        "salary": {"type": "number", "minimum": 0},
        "remote": {"type": "boolean"},
        "title": _TEXT,
    },
    "additionalProperties": False,
}
SCHEMA_20["required"] = list(SCHEMA_20["properties"])
INSTANCE = {
    "id": 7,
    "name": "Ada Lovelace",
    "email": "ada@example.org",
    "age": 36,
    "score": 9.5,
    "active": True,
    "role": "editor",
    "tags": ["math", "engines"],
    "city": "London",
    "country": "United Kingdom",
    "zip": "12345",
    "phone": "+44 20 7946 0000",
    "created": "1843-09-01",
    "notes": None,
    "rating": 5,
    "manager": {"name": "Charles Babbage", "id": 1},
    "languages": ["en", "fr"],
    "salary": 1000.0,
    "remote": False,
    "title": "Analyst",
}


def extra_body() -> dict[str, Any]:
    """The body fields that ask for SCHEMA_20 (`kvflow bench serve --extra-body`)."""
    json_schema = {"name": "person", "schema": SCHEMA_20, "strict": True}
    return {"response_format": {"type": "json_schema", "json_schema": json_schema}}


def median_ms(work: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure(tokenizer_dir: Path, batch: int) -> dict[str, Any]:
    source = ModelSource(path=tokenizer_dir, format="safetensors", name=tokenizer_dir.name)
    hf_tokenizer = load_tokenizer(source, None, Config().cache_dir)
    start = time.perf_counter()
    tokenizer = llg_tokenizer(hf_tokenizer)
    tokenizer_ms = (time.perf_counter() - start) * 1000
    spec = StructuredOutput(json=json.dumps(SCHEMA_20), source="response_format")
    checker = GrammarChecker(tokenizer, timeout_s=10.0)
    start = time.perf_counter()
    checker.check(spec)
    cold_ms = (time.perf_counter() - start) * 1000
    grammar = grammar_of(spec)
    document = hf_tokenizer.encode(json.dumps(INSTANCE), add_special_tokens=False)

    def new_matcher() -> LLMatcher:
        return LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())

    matchers = [new_matcher() for _ in range(batch)]
    bitmask = llguidance.torch.allocate_token_bitmask(batch, tokenizer.vocab_size)
    executor = LLExecutor()
    step_ms = []
    for token in document:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask_par(
            executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )
        step_ms.append((time.perf_counter() - start) * 1000)
        if not all(m.consume_token(token) for m in matchers):
            raise RuntimeError("the instance does not match its schema's grammar")
    random_ms = random_walk_ms(
        matchers_of=lambda: [new_matcher() for _ in range(batch)],
        vocab_size=tokenizer.vocab_size,
        steps=200,
    )
    return {
        "tokenizer": str(tokenizer_dir),
        "vocab_size": tokenizer.vocab_size,
        "schema_fields": len(SCHEMA_20["properties"]),
        "grammar_tokenizer_build_ms": tokenizer_ms,
        "check_cold_ms": cold_ms,  # validate + start a matcher + its first mask
        "check_cached_ms": median_ms(lambda: checker.check(spec), 20),
        "matcher_start_ms": median_ms(new_matcher, 20),
        "document_tokens": len(document),
        "batch": batch,
        "step_mask_ms_median": statistics.median(step_ms),
        "step_mask_ms_p99": sorted(step_ms)[int(0.99 * (len(step_ms) - 1))],
        # The same batch walking random allowed tokens, as a model with random weights does
        # (long strings of odd tokens, numbers of many digits): the masks the serve run meets.
        "random_walk_steps": len(random_ms),
        "random_walk_mask_ms_median": statistics.median(random_ms),
        "random_walk_mask_ms_p99": sorted(random_ms)[int(0.99 * (len(random_ms) - 1))],
        "random_walk_mask_ms_max": max(random_ms),
        "threads": torch.get_num_threads(),
    }


def random_walk_ms(matchers_of: Any, vocab_size: int, steps: int, seed: int = 0) -> list[float]:
    """Each step's mask time for a batch of matchers that each take a random allowed token
    (a row whose grammar is done leaves the batch)."""
    rng = torch.Generator().manual_seed(seed)
    matchers = matchers_of()
    bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), vocab_size)
    executor = LLExecutor()
    times = []
    for _ in range(steps):
        live = [(m, i) for i, m in enumerate(matchers) if not m.is_accepting()]
        if not live:
            break
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask_par(executor, live, bitmask)
        times.append((time.perf_counter() - start) * 1000)
        bits = ((bitmask[:, :, None] >> torch.arange(32)) & 1).reshape(len(matchers), -1)
        for matcher, row in live:
            allowed = bits[row, :vocab_size].nonzero().flatten()
            token = allowed[torch.randint(len(allowed), (1,), generator=rng)].item()
            matcher.consume_token(int(token))
    return times


def check_server(base_url: str, answers: int = 16) -> dict[str, Any]:
    """`answers` sampled completions under SCHEMA_20 from the server at `base_url`: how many
    finished (not cut by max_tokens) and how many of those validate against the schema."""
    import jsonschema  # only here: the host measurement does not need it

    def post(path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            base_url + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as reply:
            return json.load(reply)

    model = post("/v1/models")["data"][0]["id"]
    finished, invalid = 0, []
    for seed in range(answers):
        body = {
            "model": model,
            "prompt": "Describe a person:",
            "max_tokens": 800,
            "temperature": 1.0,
            "seed": seed,
            **extra_body(),
        }
        choice = post("/v1/completions", body)["choices"][0]
        if choice["finish_reason"] != "stop":
            continue
        finished += 1
        try:
            jsonschema.validate(json.loads(choice["text"]), SCHEMA_20)
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid.append(f"{type(exc).__name__}: {str(exc)[:200]}")
    return {"server": base_url, "answers": answers, "finished": finished, "invalid": invalid}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokenizer", type=Path, nargs="?", help="A tokenizer folder.")
    parser.add_argument("--batch", type=int, default=32, help="Matchers masked per step.")
    parser.add_argument("--out", type=Path, help="Write the figures here (JSON).")
    parser.add_argument("--extra-body", type=Path, help="Write the serve benchmark's body here.")
    parser.add_argument("--check", metavar="URL", help="Check a server's answers instead.")
    args = parser.parse_args()
    if args.check is not None:
        result = check_server(args.check)
        print(json.dumps(result, indent=2))
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=2))
        raise SystemExit(0 if not result["invalid"] else 1)
    if args.extra_body is not None:
        args.extra_body.write_text(json.dumps(extra_body()))
    if args.tokenizer is None:
        return
    figures = measure(args.tokenizer, args.batch)
    print(json.dumps(figures, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
