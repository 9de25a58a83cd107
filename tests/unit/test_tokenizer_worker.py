"""The tokenizer worker's core: admission errors, stop strings, echo, logprob text."""

from __future__ import annotations

import copy

from services.tokenizer.worker import TokenizerWorker
from shared.protocol import (
    ChatMessage,
    EngineRequest,
    FinishReason,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
    TextDelta,
    TokenizeRequest,
    TokenLogprobs,
)


def make_worker(tokenizer) -> TokenizerWorker:
    return TokenizerWorker(copy.copy(tokenizer), max_model_len=512)


def test_a_chat_template_error_is_the_clients_error(smollm2_tokenizer) -> None:
    worker = make_worker(smollm2_tokenizer)
    worker.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    out = worker.admit(
        GenerateRequest(
            request_id="r", sampling_params=SamplingParams(), messages=[ChatMessage("user", "hi")]
        )
    )
    assert isinstance(out, TextDelta)
    assert (out.finish_reason, out.error_param) == (FinishReason.ERROR, "messages")
    assert "roles must alternate" in out.error
    result = worker.tokenize(TokenizeRequest(request_id="t", messages=[ChatMessage("user", "x")]))
    assert result.error is not None and not worker.live


def test_out_of_vocabulary_prompt_ids_are_rejected(smollm2_tokenizer) -> None:
    worker = make_worker(smollm2_tokenizer)
    out = worker.admit(
        GenerateRequest(
            request_id="r", sampling_params=SamplingParams(), prompt_token_ids=[1, 10**9]
        )
    )
    assert isinstance(out, TextDelta) and out.error_param == "prompt"


def test_stop_string_ends_the_request_and_asks_the_scheduler_to_stop(smollm2_tokenizer) -> None:
    worker = make_worker(smollm2_tokenizer)
    params = SamplingParams(stop=["."])
    request = worker.admit(
        GenerateRequest(
            request_id="r", sampling_params=params, prompt="The capital of France is", echo=True
        )
    )
    assert isinstance(request, EngineRequest)
    ids = smollm2_tokenizer.encode(" Paris. It is big")
    lp = TokenLogprobs(ids[0], -0.1, 1, [ids[0]], [-0.1])
    deltas, stopped = worker.on_outputs(
        [
            RequestOutput(request_id="r", new_token_ids=ids[:1], new_logprobs=[lp]),
            RequestOutput(request_id="r", new_token_ids=ids[1:]),
        ]
    )
    assert deltas[0].prompt_text == "The capital of France is"  # echo, first delta only
    assert deltas[0].logprobs[0].token == " Paris" and deltas[1].prompt_text is None
    assert "".join(d.text for d in deltas) == " Paris"
    assert deltas[-1].finish_reason is FinishReason.STOP and stopped == ["r"]
    assert not worker.live  # later outputs for "r" are ignored
    assert worker.on_outputs([RequestOutput(request_id="r", new_token_ids=ids)]) == ([], [])
