"""Speculative decoding on the embedded SmolLM2-135M-Instruct (real weights, float32 on the CPU):
with each method the greedy output is the one without speculation, token for token, on a
prompt whose answer quotes it (as code edits do). The n-gram method is held to the same through
the server (tests/e2e/test_speculative_serve.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from kvflow import LLM, SamplingParams
from shared.model_config import embedded_model_path
from tests.integration.test_eagle3 import write_head

CODE = (
    "def area(width, height):\n"
    "    result = width * height\n"
    "    if result < 0:\n"
    "        raise ValueError(result)\n"
    "    return result\n"
)
MESSAGES = [
    {"role": "user", "content": f"Add type hints to this function. Reply with code only.\n\n{CODE}"}
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def config_of(method: str, tmp_path: Path) -> dict:
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": 4}
    if method == "draft_model":  # the model drafts for itself: its drafts are its tokens
        model = str(embedded_model_path())
        return {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    # A random head in the published layout, on SmolLM2's shape: drafts mostly rejected.
    target = transformers.LlamaConfig(hidden_size=576, num_hidden_layers=30, vocab_size=49152)
    head = write_head(tmp_path / "head", target, list(range(0, 49152, 16)))
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}


@pytest.mark.parametrize("method", ["suffix", "draft_model", "eagle3"])
def test_greedy_output_on_real_weights_is_the_output_without_speculation(
    method: str, smollm2: LLM, tmp_path: Path
) -> None:
    [plain] = smollm2.chat([MESSAGES], GREEDY)
    llm = LLM(
        dtype="float32",
        device="cpu",
        max_model_len=1024,
        kv_cache_memory_bytes=128 << 20,
        speculative_config=config_of(method, tmp_path),
    )
    [got] = llm.chat([MESSAGES], GREEDY)
    assert got.outputs[0].token_ids == plain.outputs[0].token_ids
    stats = llm.engine.scheduler.spec_decode
    assert stats.num_drafts > 0
    if method != "eagle3":  # the answer quotes the prompt; the draft model is the target
        assert stats.mean_acceptance_length > 1.5
