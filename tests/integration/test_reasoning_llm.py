"""Offline `LLM.chat` with a reasoning parser: the thinking in `Completion.reasoning`, the answer
in `text`, and chat_template_kwargs passed to the template. SmolLM2 never writes `</think>`, so
under deepseek_r1 its whole reply is thinking: the same text the plain model answers."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from shared.protocol import ParameterError

CHAT = [[{"role": "user", "content": "What is the capital of France?"}]]


def test_llm_chat_puts_the_thinking_apart(smollm2: LLM) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    [plain] = smollm2.chat(CHAT, greedy)
    thinking = LLM(
        dtype="float32",
        device="cpu",
        max_model_len=512,
        kv_cache_memory_bytes=32 << 20,
        reasoning_parser="deepseek_r1",
    )
    try:
        [reply] = thinking.chat(CHAT, greedy, chat_template_kwargs={"enable_thinking": True})
        assert (reply.outputs[0].reasoning, reply.text) == (plain.text, "")
        assert plain.outputs[0].reasoning == ""
        with pytest.raises(ParameterError, match="add_generation_prompt"):
            thinking.chat(CHAT, greedy, chat_template_kwargs={"add_generation_prompt": False})
    finally:
        thinking.close()
