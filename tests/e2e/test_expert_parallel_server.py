"""`kvflow serve --data-parallel-size 2 --enable-expert-parallel` on CPU (gloo): a tiny mixture
of experts with SmolLM2's tokenizer, its experts spread over both replicas. Each replica's
executor takes a round before each step; one whose scheduler is idle is woken by the other's
announcement and serves its steps with padding steps (services/executor/parallel/lockstep.py).
Requests alone (each a new wave, the other replica asleep) and together give one engine's
greedy text; a replica's executor killed takes serve down (non-zero exit)."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers

from kvflow import LLM, SamplingParams
from tests.e2e.server import start_server

PROMPTS = ["The capital of France is", "List three colours:", "def add(a, b):", "Once upon"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """A random Qwen2-MoE (six experts, two a token, a shared expert) with SmolLM2's tokenizer."""
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, initializer_range=0.5,
        eos_token_id=smollm2_tokenizer.eos_token_id, bos_token_id=smollm2_tokenizer.bos_token_id,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny-moe")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(
        folder
    )
    smollm2_tokenizer.save_pretrained(folder)
    return folder


def test_two_replicas_share_the_experts_and_give_one_engines_text(moe_dir: Path) -> None:
    one = LLM(str(moe_dir), dtype="float32", device="cpu", max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [result.outputs[0].text for result in one.generate(PROMPTS, params)]
    server = start_server(
        str(moe_dir), "--data-parallel-size", "2", "--enable-expert-parallel",
        "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20), "--drain-timeout", "5",
    )  # fmt: skip
    try:
        client = server.client()

        def complete(prompt: str) -> str:
            completion = client.completions.create(
                model=moe_dir.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return completion.choices[0].text

        assert [complete(prompt) for prompt in PROMPTS] == expected  # one at a time
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # together, on both replicas
            assert list(pool.map(complete, PROMPTS * 2)) == expected * 2
        # The replicas live and die together: one executor killed, serve exits non-zero.
        os.kill(server.child_pid("executor .*--data-parallel-rank 1"), signal.SIGKILL)
        assert server.proc.wait(timeout=180) != 0
    finally:
        server.stop()
