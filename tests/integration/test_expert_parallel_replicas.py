"""Expert parallelism across data-parallel replicas on CPU over gloo: `LLM(...,
data_parallel_size=2, enable_expert_parallel=True)` runs each replica's requests apart
(attention data parallel) while the experts spread over both replicas, half each; every
mixture-of-experts layer exchanges the replicas' tokens (services/executor/parallel/
replica_experts.py), and a replica with nothing left serves the other's steps with steps of
padding rows (services/executor/parallel/lockstep.py). Greedy tokens must be transformers'."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow import LLM, SamplingParams
from services.executor.layers.moe import SparseMoE
from shared.protocol import ParameterError
from tests.integration.test_parity import hf_greedy
from tests.integration.test_tensor_parallel import tiny_folder
from tests.integration.tiny_models import TINY, make_prompts
from tests.integration.tp_generate import generate

NUM_TOKENS = 16
SETTINGS = {"dtype": "float32", "device": "cpu", "max_model_len": 128}


@pytest.fixture(scope="module")
def folder_and_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    return tiny_folder(tmp_path_factory.mktemp("qwen2-moe"), "qwen2_moe")


@pytest.fixture(scope="module")
def replicas(folder_and_model: tuple[Path, object]) -> Iterator[LLM]:
    folder, _ = folder_and_model
    llm = LLM(str(folder), data_parallel_size=2, enable_expert_parallel=True, **SETTINGS)
    yield llm
    llm.close()


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int | list[int]) -> list[list[int]]:
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in counts]
    return [result.outputs[0].token_ids for result in llm.generate(prompts, params)]


def test_each_replica_holds_half_the_experts(replicas: LLM) -> None:
    layers = [m for m in replicas.runner.model.modules() if isinstance(m, SparseMoE)]
    assert layers and all(layer.replicas is not None for layer in layers)
    assert {(layer.first_expert, layer.num_local_experts) for layer in layers} == {(0, 3)}
    assert replicas.runner.model.expert_ranks() == [0, 0, 0, 1, 1, 1]


def test_replicas_give_transformers_tokens(
    replicas: LLM, folder_and_model: tuple[Path, object]
) -> None:
    """Five prompts of different lengths (three on replica 0, two on replica 1), each
    replica's steps of their own sizes; then shares that end at different steps, so that one
    replica serves the other's last steps with padding steps."""
    _, model = folder_and_model
    prompts = make_prompts(TINY["vocab_size"])[:5]
    expected = hf_greedy(model, prompts, NUM_TOKENS, eos_token_id=None)
    assert greedy(replicas, prompts, NUM_TOKENS) == expected
    lengths = [NUM_TOKENS, 3, NUM_TOKENS, 3, 2]  # replica 1's share ends after 3 tokens
    shorter = greedy(replicas, prompts, lengths)
    assert shorter == [tokens[:n] for tokens, n in zip(expected, lengths, strict=True)]


def test_a_replica_with_no_share_serves_the_other(
    replicas: LLM, folder_and_model: tuple[Path, object]
) -> None:
    """One prompt: replica 1 has nothing to run and takes part in every step with padding."""
    _, model = folder_and_model
    prompt = make_prompts(TINY["vocab_size"])[3:4]
    assert greedy(replicas, prompt, NUM_TOKENS) == hf_greedy(
        model, prompt, NUM_TOKENS, eos_token_id=None
    )


def test_a_failed_share_stops_the_others_and_the_replicas_go_on(
    replicas: LLM, folder_and_model: tuple[Path, object]
) -> None:
    """Replica 1's prompt is too long (ParameterError as it is added): replica 0 stops its
    long share at its next step rather than finish it, the call raises the cause, and the
    next call runs on both replicas."""
    _, model = folder_and_model
    prompts = make_prompts(TINY["vocab_size"])[:2]
    before = replicas.stats().num_generation_tokens
    with pytest.raises(ParameterError):
        greedy(replicas, [prompts[0], [5] * 200], 100)
    assert replicas.stats().num_generation_tokens - before < 50  # stopped, not finished
    expected = hf_greedy(model, prompts, NUM_TOKENS, eos_token_id=None)
    assert greedy(replicas, prompts, NUM_TOKENS) == expected


@pytest.mark.parametrize("num_prompts", [1, 3], ids=["replica-1-pads", "both-run"])
def test_two_replicas_of_two_ranks_give_transformers_tokens(
    tmp_path: Path, folder_and_model: tuple[Path, object], num_prompts: int
) -> None:
    """Two replicas of two tensor-parallel ranks each, in a process of their own (the group
    must not outlive the test): the experts over four ranks (1, 2, 1 and 2 of six), each
    replica's second rank running the launches and padding steps its first rank relays."""
    folder, model = folder_and_model
    prompts = make_prompts(TINY["vocab_size"])[:num_prompts]
    expected = hf_greedy(model, prompts, NUM_TOKENS, eos_token_id=None)
    config = {"data_parallel_size": 2, "enable_expert_parallel": True, "max_model_len": 128}
    results = generate(tmp_path, 2, str(folder), prompts, NUM_TOKENS, **config)
    assert [tokens for tokens, _ in results] == expected
