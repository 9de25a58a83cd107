"""What `LLM.generate` returns: one result per prompt, holding its n completions."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import PromptTokenLogprob, TextDelta, TokenLogprob


@dataclass
class Completion:
    """One of a prompt's n completions."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when SamplingParams.logprobs
    text: str = ""  # cut at a stop string; empty for a model without a tokenizer
    finish_reason: str | None = None  # "stop", "length" or "abort"
    reasoning: str = ""  # LLM.chat with a reasoning_parser: the thinking (`text` is the answer)
    _text_parts: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def absorb(self, delta: TextDelta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self._text_parts.append(delta.text)
        self.reasoning += delta.reasoning
        if delta.finish_reason is not None:
            self.text = "".join(self._text_parts)
            self._text_parts.clear()  # the text holds them now
            self.finish_reason = delta.finish_reason.value


@dataclass
class GenerationResult:
    """One prompt's result; `outputs` holds its n completions."""

    prompt: str | None  # the prompt's text, when it was given as text
    prompt_token_ids: list[int]
    outputs: list[Completion]
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # With SamplingParams.prompt_logprobs: each prompt token, the first without a logprob.
    prompt_logprobs: list[PromptTokenLogprob] | None = None
    embedding: list[float] | None = None  # an embed request's pooled prompt

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class EmbeddingResult:
    """What `LLM.embed` returns for one prompt."""

    prompt: str | None  # the prompt's text, when it was given as text
    prompt_token_ids: list[int]
    embedding: list[float]
