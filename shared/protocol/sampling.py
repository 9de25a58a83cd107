"""How a request samples its tokens and when it stops, and the structured output it must match."""

from __future__ import annotations

import msgspec

from shared.protocol.base import Message, require


class StructuredOutput(Message, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """What the output must match, enforced token by token (vLLM's StructuredOutputsParams).

    Exactly one of `json`, `json_object`, `regex`, `choice`, `grammar` is set.
    """

    json: str | None = None  # a JSON Schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # a Lark grammar (or GBNF, converted)
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens
    # The request field it came from ("response_format", "tools", ...), named in its errors.
    source: str = "structured_outputs"
    # Set by the tokenizer worker on a server started with --no-disable-additional-properties:
    # an object schema that does not say `additionalProperties` takes any other keys, and JSON
    # may hold the whitespace of pretty-printing. Otherwise such objects are closed and JSON
    # has at most one space between tokens, as OpenAI's strict mode and vLLM's default xgrammar
    # backend behave.
    lenient: bool = False
    # With --reasoning-parser: the grammar starts after one of these ids (`</think>`) has been
    # generated, and constrains the answer alone; empty: from the first output token.
    reasoning_end_token_ids: list[int] = []

    def validate(self) -> None:
        kinds = [self.json, self.json_object or None, self.regex, self.choice, self.grammar]
        require(
            sum(k is not None for k in kinds) == 1,
            self.source,
            "set exactly one of json, json_object, regex, choice and grammar",
        )
        require(self.choice is None or len(self.choice) > 0, self.source, "choice is empty")


class SamplingParams(Message, kw_only=True, omit_defaults=True):
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
    structured_output: StructuredOutput | None = None  # the output must match it
    # Logprobs of the prompt's tokens (each given the ones before it) and this many top
    # alternatives; the first token has none. Such a request reads no prefix cache.
    prompt_logprobs: int | None = None
    # An embedding: the prompt's pooled final hidden state comes back with the request's one
    # output (its sampled token is dropped). Such a request reads no prefix cache: mean pooling
    # needs every position's hidden state.
    embed: bool = False

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ParameterError naming the first invalid parameter."""
        require(self.temperature >= 0.0, "temperature", "must be >= 0")
        require(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        require(self.top_k is None or self.top_k >= 1, "top_k", "must be >= 1 (or None)")
        require(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        require(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        require(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        require(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        require(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        require(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be <= max_tokens",
        )
        require(self.logprobs is None or self.logprobs >= 0, "logprobs", "must be >= 0")
        require(
            self.prompt_logprobs is None or self.prompt_logprobs >= 0,
            "prompt_logprobs",
            "must be >= 0",
        )
        require(self.n >= 1, "n", "must be >= 1")
        # An embedding is made by the step that would sample the first token, which ends it.
        require(not self.embed or self.max_tokens == 1, "max_tokens", "must be 1 with embed")
        if self.structured_output is not None:
            self.structured_output.validate()
            # Once the grammar is complete only EOS is allowed, which min_tokens would forbid.
            require(self.min_tokens == 0, "min_tokens", "cannot be combined with structured output")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            require(not bad, "stop_token_ids", f"ids out of vocabulary: {bad[:5]}")
            bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size]
            require(not bad, "logit_bias", f"ids out of vocabulary: {bad[:5]}")
            for name in ("logprobs", "prompt_logprobs"):
                value = getattr(self, name)
                require(
                    value is None or value <= vocab_size,
                    name,
                    f"must be <= the vocabulary size ({vocab_size})",
                )

    def fan_out(self) -> list[SamplingParams]:
        """The parameters of the n completions of one prompt, each its own request.

        They must differ, seeded or not: a seeded request's k-th completion uses seed + k.
        """
        require(self.n >= 1, "n", "must be >= 1")
        return [
            msgspec.structs.replace(
                self, n=1, seed=None if self.seed is None else self.seed + index
            )
            for index in range(self.n)
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty reads the tokens seen so far (not only how many there are)."""
        penalties = (self.repetition_penalty, self.frequency_penalty, self.presence_penalty)
        return penalties != (1.0, 0.0, 0.0)
