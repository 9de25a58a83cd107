"""Every message that crosses a component boundary, as msgspec Structs.

The scheduler and the executor meet only through these types, whether they share a
process (offline generation) or talk over ZeroMQ (serving). Fields are appended,
never reordered; `PROTOCOL_VERSION` changes when a message changes shape.
"""

from __future__ import annotations

import enum

import msgspec

PROTOCOL_VERSION = 1


class ParameterError(ValueError):
    """A request parameter is invalid; `param` names it (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick tokens and when to stop. Defaults follow vLLM / OpenAI."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int | None = None  # keep the k most likely tokens; None keeps all
    min_p: float = 0.0  # drop tokens below min_p * p(most likely)
    seed: int | None = None  # per-request seed: same output whatever the batch
    presence_penalty: float = 0.0  # subtracted once for every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides (or multiplies) logits of seen tokens
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    logprobs: int | None = None  # number of top logprobs to return per token
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # EOS and stop_token_ids are masked before this many tokens
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    stop: list[str] = []  # stop strings, matched by the detokenizer
    skip_special_tokens: bool = True
    n: int = 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ParameterError naming the first invalid parameter."""
        _check(self.temperature >= 0.0, "temperature", "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k is None or self.top_k >= 1, "top_k", "must be >= 1 (or None)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be <= max_tokens",
        )
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]")
        _check(self.n >= 1, "n", "must be >= 1")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            _check(not bad, "stop_token_ids", f"ids out of vocabulary: {bad[:5]}")
            bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size]
            _check(not bad, "logit_bias", f"ids out of vocabulary: {bad[:5]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParameterError(param, message)


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


# ---------------------------------------------------------------- requests in


class EngineRequest(msgspec.Struct, tag=True, kw_only=True):
    """A tokenized request, as the scheduler receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


# ---------------------------------------------------------- scheduler -> executor


class NewRequestData(msgspec.Struct, kw_only=True):
    """A request the executor has no state for: first scheduled, or resumed after preemption."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resumed after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix hits)


class CachedRequestData(msgspec.Struct, kw_only=True):
    """A request the executor already holds: only what changed since the last step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


class SchedulerOutput(msgspec.Struct, tag=True, kw_only=True):
    """The plan of one step.

    NOTE: `num_scheduled_tokens` is ordered: the executor lays out the batch in this
    order. `finished_request_ids` lists requests whose state the executor must drop
    (finished, aborted or preempted) since the previous step.
    """

    step: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    finished_request_ids: list[str]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


# ---------------------------------------------------------- executor -> scheduler


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprob of the sampled token, its rank, and the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class ModelRunnerOutput(msgspec.Struct, tag=True, kw_only=True):
    """Tokens sampled in one step, for the requests that reached the end of their input."""

    step: int
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = {}


# ------------------------------------------------------------- outputs out


class RequestOutput(msgspec.Struct, tag=True, kw_only=True):
    """What one step produced for one request: new tokens and, at the end, why it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = []
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
