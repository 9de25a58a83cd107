"""Prompt logprobs (the `prompt_logprobs` sampling parameter): each prompt token's logprob and
the top-k of its position, from the hidden states of the step that runs the prompt."""

from __future__ import annotations

import torch

from services.executor.models.decoder import DecoderForCausalLM
from services.executor.runner.sampler import PendingSample, logprob_tensors, to_device
from services.executor.runner.step_state import RequestState

_PROMPT_LOGPROB_ROWS = 512  # prompt positions whose logits are made at once


def prompt_logprobs(
    model: DecoderForCausalLM,
    hidden: torch.Tensor,  # [T, hidden], the step's
    state: RequestState,
    request_id: str,
    first: int,
    start: int,
    count: int,
) -> tuple[str, int, PendingSample]:
    """Queue the logprobs of prompt tokens start + 1 .. start + count, from the hidden states
    at token indices first .. first + count - 1, and their copy to the host."""
    k = state.params.prompt_logprobs or 0
    targets = state.prompt_token_ids[start + 1 : start + 1 + count]
    target_ids = to_device(targets, torch.int64, hidden.device)
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    vocab_size = model.config.vocab_size
    # Why in slices: a 2,048-token chunk's float32 logits over a 150k vocabulary are 1.2 GB.
    for lo in range(0, count, _PROMPT_LOGPROB_ROWS):
        hi = min(lo + _PROMPT_LOGPROB_ROWS, count)
        logits = model.compute_logits(hidden[first + lo : first + hi])  # [n, vocab]
        raw = logits[:, :vocab_size].float().log_softmax(dim=-1)
        for column, tensor in zip(parts, logprob_tensors(raw, target_ids[lo:hi], k), strict=True):
            column.append(tensor)
    tensors = tuple(torch.cat(column) for column in parts)
    return request_id, start + 1, PendingSample(target_ids, tensors, [k] * count)
