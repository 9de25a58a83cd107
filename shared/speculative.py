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
BUILT_METHODS = ("ngram", "suffix", "draft_model", "eagle3")
# vLLM's n-gram window when neither bound is given.
DEFAULT_NGRAM_WINDOW = 5
_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"},
    "suffix": {
        "method",
        "num_speculative_tokens",
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
    },
    "draft_model": {
        "method",
        "model",
        "num_speculative_tokens",
        "draft_tensor_parallel_size",
        "quantization",
    },
    "eagle3": {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size"},
}


class SpeculativeConfigError(ValueError):
    """A --speculative-config that cannot run; the message says why."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # drafts verified per step, at most
    prompt_lookup_min: int = 0  # ngram: the shortest suffix matched
    prompt_lookup_max: int = 0  # ngram: the longest suffix tried first
    # suffix (vLLM's defaults): the longest suffix matched; how many ended requests' outputs
    # are searched too; drafts at most this times the match's length; the least probability
    # of a draft's path.
    suffix_max_tree_depth: int = 24
    suffix_max_cached_requests: int = 10000
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    # draft_model, eagle3: the draft's (or the EAGLE-3 head's) folder or preset; the draft's
    # --quantization.
    draft_model: str | None = None
    draft_quantization: str | None = None

    @property
    def lookahead(self) -> int:
        """KV slots past a request's tokens that its blocks must hold for the next proposal:
        a draft model writes the KV of each draft but the last; an EAGLE-3 head, whose pass
        at a position reads the token after it, one fewer."""
        if self.method == "draft_model":
            return self.num_speculative_tokens
        return self.num_speculative_tokens - 1 if self.method == "eagle3" else 0


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
    unknown = sorted(set(raw) - _KEYS[method])
    if unknown:
        raise SpeculativeConfigError(f"keys {unknown} do not apply to method {method!r}")
    if method in ("draft_model", "eagle3"):
        return _draft_model_config(method, raw)
    return _ngram_config(raw) if method == "ngram" else _suffix_config(raw)


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


def _suffix_config(raw: dict[str, Any]) -> SpeculativeConfig:
    depth = _positive_int(raw, "suffix_decoding_max_tree_depth", 24)
    cached = _positive_int(raw, "suffix_decoding_max_cached_requests", 10000, least=0)
    factor = _number(raw, "suffix_decoding_max_spec_factor", 1.0)
    prob = _number(raw, "suffix_decoding_min_token_prob", 0.1)
    if prob > 1:
        raise SpeculativeConfigError("suffix_decoding_min_token_prob must be <= 1")
    # vLLM's default: as many drafts as the deepest match allows.
    num = _positive_int(raw, "num_speculative_tokens", depth)
    return SpeculativeConfig("suffix", num, 0, 0, depth, cached, factor, prob)


def _draft_model_config(method: str, raw: dict[str, Any]) -> SpeculativeConfig:
    num = _positive_int(raw, "num_speculative_tokens", None)
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        what = "the draft model's" if method == "draft_model" else "the EAGLE-3 head's"
        raise SpeculativeConfigError(f"model ({what} folder or name) is required")
    if raw.get("draft_tensor_parallel_size", 1) != 1:
        raise SpeculativeConfigError(
            "draft_tensor_parallel_size must be 1: the draft model runs whole on the first rank"
        )
    quantization = raw.get("quantization")
    if quantization is not None and not isinstance(quantization, str):
        raise SpeculativeConfigError("quantization must be a string")
    return SpeculativeConfig(method, num, draft_model=model, draft_quantization=quantization)


def _positive_int(raw: dict[str, Any], key: str, default: int | None, least: int = 1) -> int:
    value = raw.get(key, default)
    if value is None:
        raise SpeculativeConfigError(f"{key} is required")
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise SpeculativeConfigError(f"{key} must be an integer >= {least}")
    return value


def _number(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise SpeculativeConfigError(f"{key} must be a number >= 0")
    return float(value)


def speculates(params: SamplingParams) -> bool:
    """Whether a request with these parameters verifies drafts: all but embeddings (no
    output). Each position of a row samples as if the drafts before it were output: penalties
    count them, a grammar has read them."""
    return not params.embed
