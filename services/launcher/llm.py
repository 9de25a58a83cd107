"""Offline batch generation: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.launcher.engine import Engine
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.hf_tokenizer import apply_chat_template, load_tokenizer
from shared.config import Config
from shared.protocol import (
    EngineRequest,
    FinishReason,
    ParameterError,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)

logger = logging.getLogger(__name__)
Prompt = str | list[int]


@dataclass
class Completion:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


@dataclass
class GenerationResult:
    """One prompt's result; `outputs` holds its n completions."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion]
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.config = Config(model=model, **config)
        self.engine = Engine(self.config)
        self.tokenizer = load_tokenizer(self.engine.source, self.config.tokenizer)
        self._next_id = 0

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        show_progress: bool = False,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text or token ids) in one continuous batch.

        `sampling_params` is one for all prompts, or a list with one per prompt.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ParameterError("sampling_params", "give one per prompt, or a single one")
        results = [self._result(p) for p in prompts]  # type: ignore[union-attr]
        return self._run(results, per_prompt, show_progress)

    def chat(
        self,
        conversations: list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        show_progress: bool = False,
    ) -> list[GenerationResult]:
        """Generate a reply for each conversation, through the model's chat template."""
        tokenizer = self._require_tokenizer()
        token_ids = [apply_chat_template(tokenizer, messages) for messages in conversations]
        return self.generate(token_ids, sampling_params, show_progress=show_progress)

    def _result(self, prompt: Prompt) -> GenerationResult:
        if isinstance(prompt, str):
            ids = self._require_tokenizer().encode(prompt)
            return GenerationResult(prompt, ids, [])
        return GenerationResult(None, list(prompt), [])

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ParameterError("prompt", "this model has no tokenizer: pass token ids")
        return self.tokenizer

    def _run(
        self,
        results: list[GenerationResult],
        per_prompt: list[SamplingParams],
        show_progress: bool,
    ) -> list[GenerationResult]:
        pending: dict[str, _Pending] = {}
        try:
            for result, params in zip(results, per_prompt, strict=True):
                for index in range(params.n):
                    request_id = f"gen-{self._next_id}"
                    self._next_id += 1
                    self.engine.add_request(
                        EngineRequest(
                            request_id=request_id,
                            prompt_token_ids=result.prompt_token_ids,
                            sampling_params=_child_params(params, index),
                            arrival_time=time.time(),
                        )
                    )
                    result.outputs.append(Completion(index))
                    pending[request_id] = _Pending(
                        result,
                        result.outputs[-1],
                        self._detokenizer(result.prompt_token_ids, params),
                    )
        except ParameterError:
            self.engine.abort(list(pending))
            raise
        progress = _Progress(len(pending), show_progress)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id in pending:
                    done = self._absorb(out, pending[out.request_id])
                    progress.update(len(out.new_token_ids), done)
                    if done:
                        del pending[out.request_id]
        progress.close()
        return results

    def _detokenizer(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
        )

    def _absorb(self, out: RequestOutput, pending: _Pending) -> bool:
        """Take one step's output for a request; True when the request is done."""
        completion, detokenizer = pending.completion, pending.detokenizer
        completion.token_ids.extend(out.new_token_ids)
        completion.logprobs.extend(out.new_logprobs)
        pending.result.num_cached_tokens = max(
            pending.result.num_cached_tokens, out.num_cached_tokens
        )
        reason = out.finish_reason
        if detokenizer is not None:
            detokenizer.add(out.new_token_ids)
            if detokenizer.stop_hit is not None:
                if reason is None:
                    self.engine.abort([out.request_id])
                reason = FinishReason.STOP
            elif reason is not None:
                detokenizer.flush()
            completion.text = detokenizer.text
        if reason is not None:
            completion.finish_reason = reason.value
        return reason is not None

    def stats(self) -> Any:
        return self.engine.stats()


@dataclass
class _Pending:
    result: GenerationResult
    completion: Completion
    detokenizer: IncrementalDetokenizer | None


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The n completions of one prompt must differ, seeded or not: offset the seed."""
    if params.seed is None or index == 0:
        return params
    return msgspec.structs.replace(params, seed=params.seed + index)


class _Progress:
    """A one-line progress report on stderr, at most twice a second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled and total > 1
        self.done = self.tokens = 0
        self.start = self.last = time.perf_counter()

    def update(self, num_tokens: int, done: bool) -> None:
        self.tokens += num_tokens
        self.done += done
        now = time.perf_counter()
        if self.enabled and (now - self.last > 0.5 or self.done == self.total):
            self.last = now
            rate = self.tokens / max(now - self.start, 1e-9)
            print(
                f"\rgenerated {self.done}/{self.total} requests, {rate:.0f} tok/s",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)
