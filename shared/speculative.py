"""Speculative decoding's settings, read from `--speculative-config` (vLLM's JSON keys), and which
requests speculate.

A step of a speculating request computes its last token and the drafts a proposer guessed after
it; the target's own choice at each position is sampled as without speculation, and the drafts
are accepted while they equal it (docs/architecture.md, speculative decoding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shared.protocol import SamplingParams

# The methods vLLM names, and the ones kvflow runs today.
METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp")
BUILT_METHODS = ("ngram",)
# vLLM's n-gram window when neither bound is given.
DEFAULT_NGRAM_WINDOW = 5
_NGRAM_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}


class SpeculativeConfigError(ValueError):
    """A --speculative-config that cannot run; the message says why."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # drafts verified per step, at most
    prompt_lookup_min: int  # n-gram: the shortest suffix matched
    prompt_lookup_max: int  # n-gram: the longest suffix tried first


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The settings a --speculative-config JSON object gives (None: no speculation); raises
    SpeculativeConfigError naming what is wrong."""
    if text is None or not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpeculativeConfigError(f"not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise SpeculativeConfigError("must be a JSON object")
    method = raw.get("method", "draft_model" if "model" in raw else None)
    if method not in METHODS:
        raise SpeculativeConfigError(f"method must be one of {', '.join(METHODS)}")
    if method not in BUILT_METHODS:
        raise SpeculativeConfigError(
            f"method {method!r} is not built yet; built: {', '.join(BUILT_METHODS)}"
        )
    unknown = sorted(set(raw) - _NGRAM_KEYS)
    if unknown:
        raise SpeculativeConfigError(f"keys {unknown} do not apply to method {method!r}")
    return _ngram_config(raw)


def _ngram_config(raw: dict[str, Any]) -> SpeculativeConfig:
    num = _positive_int(raw, "num_speculative_tokens", None)
    low = raw.get("prompt_lookup_min")
    high = raw.get("prompt_lookup_max")
    # vLLM's defaults: one bound given stands for both; neither, a window of 5.
    low = _positive_int(raw, "prompt_lookup_min", high or DEFAULT_NGRAM_WINDOW)
    high = _positive_int(raw, "prompt_lookup_max", low)
    if low > high:
        raise SpeculativeConfigError("prompt_lookup_min must be <= prompt_lookup_max")
    return SpeculativeConfig("ngram", num, low, high)


def _positive_int(raw: dict[str, Any], key: str, default: int | None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise SpeculativeConfigError(f"{key} is required")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpeculativeConfigError(f"{key} must be an integer >= 1")
    return value


def speculates(params: SamplingParams) -> bool:
    """Whether a request with these parameters verifies drafts. Those that need each step's
    state on the host before the next (penalties count every token, a grammar advances on it)
    and embeddings (no output) run one token a step, in the same batches."""
    return not (params.has_penalties or params.structured_output is not None or params.embed)
