"""A tokenizer worker's core: text in, token ids to the scheduler; token ids back, text out.

It keeps one incremental detokenizer per live request (requests are sticky to a worker),
finds stop strings, and turns logprobs into token text. No sockets here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from services.tokenizer.detokenizer import IncrementalDetokenizer, token_text
from services.tokenizer.hf_tokenizer import apply_chat_template
from shared.protocol import (
    EngineRequest,
    FinishReason,
    GenerateRequest,
    ParameterError,
    RequestOutput,
    TextDelta,
    TokenizeRequest,
    TokenizeResult,
    TokenLogprob,
    TokenLogprobs,
)

logger = logging.getLogger(__name__)


@dataclass
class _LiveRequest:
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    echo_prompt_ids: list[int] | None  # sent back with the first delta when echo is asked
    num_output_tokens: int = 0


class TokenizerWorker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.live: dict[str, _LiveRequest] = {}

    # ---------------------------------------------------------------- inbound

    def admit(self, request: GenerateRequest) -> EngineRequest | TextDelta:
        """Tokenize a request for the scheduler, or answer it with an error delta."""
        try:
            token_ids = self._prompt_ids(request)
        except Exception as exc:  # chat templates raise jinja2 errors for bad conversations
            param = (
                exc.param
                if isinstance(exc, ParameterError)
                else ("messages" if request.messages is not None else "prompt")
            )
            return TextDelta.failure(request.request_id, str(exc), param)
        params = request.sampling_params
        self.live[request.request_id] = _LiveRequest(
            IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
            ),
            num_prompt_tokens=len(token_ids),
            echo_prompt_ids=token_ids if request.echo else None,
        )
        return EngineRequest(
            request_id=request.request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=request.arrival_time,
        )

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.messages is not None:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            return apply_chat_template(self.tokenizer, messages)
        if request.prompt_token_ids is not None:
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in request.prompt_token_ids):
                raise ParameterError("prompt", f"token ids must be in [0, {vocab})")
            return list(request.prompt_token_ids)
        return self.tokenizer.encode(request.prompt or "")

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.live.pop(request_id, None)

    def tokenize(self, request: TokenizeRequest) -> TokenizeResult:
        try:
            if request.token_ids is not None:
                text = self.tokenizer.decode(request.token_ids)
                return TokenizeResult(
                    request_id=request.request_id, text=text, token_ids=request.token_ids
                )
            if request.messages is not None:
                messages = [{"role": m.role, "content": m.content} for m in request.messages]
                ids = apply_chat_template(self.tokenizer, messages)
            else:
                ids = self.tokenizer.encode(
                    request.prompt or "", add_special_tokens=request.add_special_tokens
                )
        except Exception as exc:  # a bad conversation or id is the client's error
            return TokenizeResult(
                request_id=request.request_id, error=str(exc), error_param="tokens"
            )
        return TokenizeResult(
            request_id=request.request_id, token_ids=ids, max_model_len=self.max_model_len
        )

    # ---------------------------------------------------------------- outbound

    def on_outputs(self, outputs: list[RequestOutput]) -> tuple[list[TextDelta], list[str]]:
        """Text deltas for the frontend, and the requests a stop string has ended."""
        deltas, stopped = [], []
        for output in outputs:
            live = self.live.get(output.request_id)
            if live is None:
                continue  # aborted, or ended by a stop string already
            delta = self._delta(output, live)
            if delta.finish_reason is FinishReason.STOP and not output.finished:
                stopped.append(output.request_id)
            if delta.finish_reason is not None:
                del self.live[output.request_id]
            deltas.append(delta)
        return deltas, stopped

    def _delta(self, output: RequestOutput, live: _LiveRequest) -> TextDelta:
        detokenizer = live.detokenizer
        text = detokenizer.add(output.new_token_ids)
        finish = output.finish_reason
        if detokenizer.stop_hit is not None:
            finish = FinishReason.STOP
        elif finish is not None:
            text += detokenizer.flush()
        live.num_output_tokens += len(output.new_token_ids)
        delta = TextDelta(
            request_id=output.request_id,
            text=text,
            token_ids=output.new_token_ids,
            logprobs=[self._logprob(lp) for lp in output.new_logprobs],
            finish_reason=finish,
            num_prompt_tokens=live.num_prompt_tokens,
            num_output_tokens=live.num_output_tokens,
            num_cached_tokens=output.num_cached_tokens,
            error=output.error,
            error_param=output.error_param,
            error_code=output.error_code,
        )
        if live.echo_prompt_ids is not None:
            delta.prompt_token_ids = live.echo_prompt_ids
            delta.prompt_text = self.tokenizer.decode(live.echo_prompt_ids)
            live.echo_prompt_ids = None
        return delta

    def _logprob(self, lp: TokenLogprobs) -> TokenLogprob:
        top = [
            (token_text(self.tokenizer, t), v)
            for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
        ]
        return TokenLogprob(token_text(self.tokenizer, lp.token_id), lp.logprob, top)
