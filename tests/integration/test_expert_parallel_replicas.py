"""Expert parallelism across data-parallel replicas on CPU over gloo: `LLM(...,
data_parallel_size=2, enable_expert_parallel=True)` runs each replica's requests apart
(attention data parallel) while the experts spread over both replicas, half each; every
mixture-of-experts layer exchanges the replicas' tokens (services/executor/parallel/
replica_experts.py), and a replica with nothing left serves the other's steps with steps of
padding rows (services/executor/parallel/lockstep.py). Greedy tokens must be transformers'."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams
from services.executor.layers.moe import SparseMoE
from services.executor.parallel.replica_experts import ReplicaExperts
from shared.protocol import ParameterError
from tests.integration import padded_graphs
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


def test_padding_rows_choose_no_expert(replicas: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replica 0's first mixture-of-experts layer, in steps where the replicas run different
    rows: the gathered rows past a replica's own (padding to the most any replica has) choose
    expert -1 (none computes them), while the replicas' own rows choose this rank's experts
    (or -1 for the other rank's). The padding rows hold noise here, as a graph's padded rows
    hold hidden states (zeros would route to the other rank's experts anyway: ties)."""
    layer = next(m for m in replicas.runner.model.modules() if isinstance(m, SparseMoE))
    assert layer.replicas is not None
    step, apply, gather = layer.replicas.step, layer.method.apply, ReplicaExperts.gather
    seen: list[tuple[tuple[int, ...], int, torch.Tensor]] = []

    def noisy_gather(self: ReplicaExperts, x: torch.Tensor) -> torch.Tensor:
        rows = gather(self, x)
        padded = rows.shape[0] // self.replicas
        for replica, own in enumerate(self.step.rows or ()):
            padding = rows[replica * padded + own : (replica + 1) * padded]
            padding.copy_(torch.randn_like(padding))
        return rows

    def recording_apply(module, tokens, weights, ids):  # type: ignore[no-untyped-def]
        if module is layer and step.rows is not None:
            seen.append((step.rows, step.padded or 0, ids.clone()))
        return apply(module, tokens, weights, ids)

    monkeypatch.setattr(ReplicaExperts, "gather", noisy_gather)
    monkeypatch.setattr(layer.method, "apply", recording_apply)
    greedy(replicas, make_prompts(TINY["vocab_size"])[:3], 4)  # rows 2 and 1 at decode
    uneven = [(rows, padded, ids) for rows, padded, ids in seen if min(rows) < padded]
    assert uneven
    chosen = 0
    for rows, padded, ids in uneven:
        by_replica = ids.reshape(len(rows), padded, -1)
        for replica, own in enumerate(rows):
            assert (by_replica[replica, own:] == -1).all()
            chosen += int((by_replica[replica, :own] >= 0).sum())
    assert chosen


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


def test_two_replicas_of_two_ranks_give_transformers_tokens(
    tmp_path: Path, folder_and_model: tuple[Path, object]
) -> None:
    """Two replicas of two tensor-parallel ranks each, in a process of their own (the group
    must not outlive the test): the experts over four ranks (1, 2, 1 and 2 of six), each
    replica's second rank running the launches and padding steps its first rank relays (one
    prompt: replica 1 pads every step), every step eagerly. Both replicas running rows on two
    ranks each, padded as graphs: the padded test's "two-ranks-each"."""
    folder, model = folder_and_model
    prompts = make_prompts(TINY["vocab_size"])[:1]
    expected = hf_greedy(model, prompts, NUM_TOKENS, eos_token_id=None)
    config = {"data_parallel_size": 2, "enable_expert_parallel": True, "max_model_len": 128}
    results = generate(tmp_path, 2, str(folder), prompts, NUM_TOKENS, **config)
    assert [tokens for tokens, _ in results] == expected


# (ranks a replica, prompts, --max-num-batched-tokens) -> the graphs' replays by token count
# (None: some, their count the scheduler's choice of chunks)
PADDED_JOBS: dict[str, tuple[int, int, int | None, dict[int, int | None]]] = {
    # Decode steps of 1 row: replica 0's, and replica 1's padding step, each replaying the
    # graph of 1; the prefill of 3 tokens makes its round a mixed one, of the smallest mixed
    # graph's 16 rows: replica 0 replays that graph, replica 1 the decode graph of 16 with
    # padding alone (a round of the smallest graph's 4 rows would find no mixed graph of 4).
    "replica-1-pads": (1, 1, None, {1: 2 * (NUM_TOKENS - 1), 16: 2}),
    # Chunks of 16 tokens (the mixed graph of 16, replica 1's last ones shorter: padded to
    # it), then decode steps of 3 and 2 rows (both replaying the graph of 4).
    "both-run-chunked": (1, 5, 16, {16: None, 4: None}),
    # Two ranks a replica, each replaying what its first rank's round chose: the prefill's
    # mixed round of 32 rows (19 tokens and 9), then decode rounds of rows 2 and 1.
    "two-ranks-each": (2, 3, None, {32: 4, 2: 4 * (NUM_TOKENS - 1)}),
}


@pytest.mark.parametrize("job", sorted(PADDED_JOBS))
def test_steps_padded_as_graphs_give_transformers_tokens(
    tmp_path: Path,
    folder_and_model: tuple[Path, object],
    monkeypatch: pytest.MonkeyPatch,
    job: str,
) -> None:
    """Every replica's steps padded as CUDA graphs pad them (tests/integration/padded_graphs.py,
    in every process the job starts): a round's rows are the smallest graph's that holds the
    most any replica runs, a replica with fewer pads its own to them (its padding rows choose
    no expert: the replicas' rows on the device say which), and one with none replays that
    graph's padding alone. Prompts of 3, 9, 16, 17 and 30 tokens, in turn to each replica."""
    ranks, num_prompts, chunk, expected_replays = PADDED_JOBS[job]
    folder, model = folder_and_model
    log = tmp_path / "replays"
    log.mkdir()
    for name, value in padded_graphs.environment(log).items():
        monkeypatch.setenv(name, value)
    prompts = make_prompts(TINY["vocab_size"])[:num_prompts]
    expected = hf_greedy(model, prompts, NUM_TOKENS, eos_token_id=None)
    config = {"data_parallel_size": 2, "enable_expert_parallel": True, "max_model_len": 128}
    if chunk is not None:
        config["max_num_batched_tokens"] = chunk
    results = generate(tmp_path, ranks, str(folder), prompts, NUM_TOKENS, **config)
    assert [tokens for tokens, _ in results] == expected
    logged = padded_graphs.replayed(log)
    assert all(tokens == rows for tokens, rows in logged), "replays sent other rows than captured"
    replays = Counter(tokens for tokens, _ in logged)
    if None in expected_replays.values():
        assert all(replays[size] for size in expected_replays), replays
    else:
        assert replays == expected_replays
