"""Expert parallelism across two data-parallel replicas on two GPUs (NCCL's all-gather and
reduce-scatter), against one GPU, on a tiny Qwen2-MoE in float32: the same greedy tokens with
every replica's steps in CUDA graphs (the round's rows, the graphs captured across the replicas,
padding replayed by a replica with nothing to run) and eagerly. Five prompts (both replicas run
rows, unevenly) and one (replica 1 only pads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_tensor_parallel import tiny_folder
from tests.integration.tiny_models import TINY, make_prompts
from tests.integration.tp_generate import generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
NUM_TOKENS = 32


@pytest.mark.parametrize("num_prompts", [5, 1])
def test_two_replicas_in_graphs_and_eagerly_give_the_tokens_of_one_gpu(
    tmp_path: Path, num_prompts: int
) -> None:
    folder, _ = tiny_folder(tmp_path / "model", "qwen2_moe")
    prompts = make_prompts(TINY["vocab_size"], seed=3)[:num_prompts]
    settings = {"device": "cuda", "dtype": "float32", "gpu_memory_utilization": 0.3}
    replicas = {**settings, "data_parallel_size": 2, "enable_expert_parallel": True}

    def tokens(name: str, **config: object) -> list[list[int]]:
        results = generate(tmp_path / name, 1, str(folder), prompts, NUM_TOKENS, **config)
        return [t for t, _ in results]

    one = tokens("one", **settings)
    assert tokens("graphs", **replicas) == one
    assert tokens("eager", **replicas, enforce_eager=True) == one
