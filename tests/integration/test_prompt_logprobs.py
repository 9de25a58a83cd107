"""Prompt logprobs (SamplingParams.prompt_logprobs, and echo with logprobs over HTTP) equal a
full-prompt forward pass of the reference model, whatever the chunking and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kvflow import LLM, SamplingParams
from shared.protocol import PromptTokenLogprob

PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin. Both are large",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Ünïcödé and emoji 🙂 make several tokens per character",
]
TOP_K = 3


@pytest.fixture(scope="module")
def reference(tool_chat_model_dir: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tool_chat_model_dir, dtype=torch.float32
    )
    return model.eval()


def reference_logprobs(
    model: transformers.PreTrainedModel, token_ids: list[int]
) -> torch.Tensor:  # [len - 1, vocab]: row i scores token i + 1
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]
    return logits.log_softmax(dim=-1)[:-1]


def check_against_reference(
    model: transformers.PreTrainedModel,
    token_ids: list[int],
    entries: list[PromptTokenLogprob] | None,
) -> None:
    assert entries is not None and len(entries) == len(token_ids)
    assert [e.token_id for e in entries] == token_ids
    assert (entries[0].logprob, entries[0].rank, entries[0].top) == (None, None, [])
    expected = reference_logprobs(model, token_ids)  # [len - 1, vocab]
    for position, entry in enumerate(entries[1:]):
        row = expected[position]
        target = row[entry.token_id].item()
        assert entry.logprob == pytest.approx(target, abs=1e-4)
        assert entry.rank == int((row > target).sum().item()) + 1
        top = row.topk(TOP_K)
        assert [t.token_id for t in entry.top] == top.indices.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [2048, 7])  # whole prompts in one step, or 7-token chunks
def test_prompt_logprobs_match_a_full_forward_pass(
    tool_chat_model_dir: Path, reference: transformers.PreTrainedModel, budget: int
) -> None:
    llm = LLM(
        str(tool_chat_model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_batched_tokens=budget,
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP_K)
    # Twice each: the second of a pair would hit the prefix cache, which such requests skip.
    results = llm.generate(PROMPTS + PROMPTS, params)
    for result in results:
        check_against_reference(reference, result.prompt_token_ids, result.prompt_logprobs)
        assert result.num_cached_tokens == 0
    # Requests without prompt logprobs in the same engine get none.
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=1))[0].prompt_logprobs is None


@pytest.mark.slow
def test_prompt_logprobs_survive_preemption(
    tool_chat_model_dir: Path, reference: transformers.PreTrainedModel
) -> None:
    """A pool too small for every request at once: requests are preempted mid-prompt (their
    chunks are computed again) and mid-output; each prompt's logprobs still come once, whole."""
    llm = LLM(
        str(tool_chat_model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        block_size=8,
        num_gpu_blocks_override=24,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    prompts = [f"{i}: {PROMPTS[i % len(PROMPTS)]}" for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    results = llm.generate(prompts, params)
    assert llm.stats().num_preemptions > 0
    for result in results:
        entries = result.prompt_logprobs
        assert entries is not None and len(entries) == len(result.prompt_token_ids)
        expected = reference_logprobs(reference, result.prompt_token_ids)
        got = torch.tensor([e.logprob for e in entries[1:]])
        want = expected.gather(1, torch.tensor(result.prompt_token_ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
