"""What one request may ask for: the operator's limits (the `limits` flags), checked on a
decoded body before any work is spent on it; beyond one, a 400 that names the parameter and
the flag that sets the limit."""

from __future__ import annotations

from dataclasses import dataclass

from services.frontend.api.endpoints import Inputs
from shared.config import Config
from shared.protocol import ParameterError


@dataclass(frozen=True)
class RequestLimits:
    max_num_messages: int
    max_num_prompts: int
    max_prompt_chars: int
    max_n: int
    max_tokens: int | None
    max_logprobs: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_logit_bias: int

    @classmethod
    def of(cls, config: Config) -> RequestLimits:
        return cls(
            max_num_messages=config.max_num_messages,
            max_num_prompts=config.max_num_prompts,
            max_prompt_chars=config.max_prompt_chars,
            max_n=config.max_n,
            max_tokens=config.max_tokens_limit,
            max_logprobs=config.max_logprobs,
            max_stop_strings=config.max_stop_strings,
            max_stop_string_chars=config.max_stop_string_chars,
            max_logit_bias=config.max_logit_bias,
        )

    def check(self, inputs: Inputs, logprobs_param: str = "logprobs") -> None:
        """Raise ParameterError at the first limit `inputs` passes."""
        _within(len(inputs.prompts), self.max_num_prompts, "prompt", "prompts", "max-num-prompts")
        for prompt in inputs.prompts:
            if prompt.messages is not None:
                num = len(prompt.messages)
                _within(num, self.max_num_messages, "messages", "messages", "max-num-messages")
                for message in prompt.messages:
                    chars = len(message.content)
                    _within(chars, self.max_prompt_chars, "messages", "chars", "max-prompt-chars")
            if prompt.text is not None:
                chars = len(prompt.text)
                _within(chars, self.max_prompt_chars, "prompt", "chars", "max-prompt-chars")
        params = inputs.params
        _within(params.n, self.max_n, "n", "completions", "max-n")
        if self.max_tokens is not None and params.max_tokens is not None:
            _within(params.max_tokens, self.max_tokens, "max_tokens", "tokens", "max-tokens-limit")
        if params.logprobs is not None:
            _within(params.logprobs, self.max_logprobs, logprobs_param, "", "max-logprobs")
        _within(len(params.stop), self.max_stop_strings, "stop", "strings", "max-stop-strings")
        for stop in params.stop:
            chars = len(stop)
            _within(chars, self.max_stop_string_chars, "stop", "chars", "max-stop-string-chars")
        num_bias = len(params.logit_bias or {})
        _within(num_bias, self.max_logit_bias, "logit_bias", "entries", "max-logit-bias")


def _within(value: int, limit: int, param: str, unit: str, flag: str) -> None:
    if value > limit:
        what = f"{value} {unit}".strip()
        raise ParameterError(param, f"{what} is more than this server allows ({limit}, --{flag})")
