"""Offline data parallelism: `LLM(..., data_parallel_size=2)` deals a batch out to two engine
replicas (this process, and one of its own) and gives what one engine gives, in order."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow import LLM, SamplingParams
from shared.protocol import ParameterError

PROMPTS = [[5, 9, 11, 40], [7] * 20, list(range(3, 40)), [1, 2, 3], [60] * 9]
SETTINGS = {"dtype": "float32", "device": "cpu", "max_model_len": 128}


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_llama_dir), data_parallel_size=2, **SETTINGS)
    yield llm
    assert llm.replicas is not None
    llm.replicas.stop()


def tokens(llm: LLM, prompts: list[list[int]], **params: object) -> list[list[list[int]]]:
    sampling = SamplingParams(max_tokens=10, ignore_eos=True, **params)
    return [[c.token_ids for c in r.outputs] for r in llm.generate(prompts, sampling)]


def test_two_replicas_give_one_engines_tokens_in_the_prompts_order(
    replicas: LLM, tiny_llama_dir: Path
) -> None:
    one = LLM(str(tiny_llama_dir), **SETTINGS)
    assert tokens(replicas, PROMPTS, temperature=0.0) == tokens(one, PROMPTS, temperature=0.0)
    # Seeded sampling, n completions each: every completion is its own, whichever replica.
    seeded = {"temperature": 1.0, "seed": 3, "n": 2}
    assert tokens(replicas, PROMPTS, **seeded) == tokens(one, PROMPTS, **seeded)
    stats = replicas.replica_stats()
    assert [s.replica for s in stats] == [0, 1]
    # Prompts 0, 2, 4 went to replica 0, and 1, 3 to replica 1: three times each (once
    # greedy, twice for n=2).
    assert [s.num_prompt_tokens for s in stats] == [3 * (4 + 37 + 9), 3 * (20 + 3)]
    assert all(s.num_running == s.num_waiting == 0 for s in stats)


def test_a_bad_prompt_in_another_replicas_share_fails_the_call_and_the_next_runs(
    replicas: LLM,
) -> None:
    too_long = [[5] * 200]
    with pytest.raises(ParameterError, match="max_model_len is 128"):
        tokens(replicas, [PROMPTS[0], *too_long, PROMPTS[1]])  # the second: replica 1's
    with pytest.raises(ParameterError, match="max_model_len is 128"):
        tokens(replicas, [*too_long, *PROMPTS])  # replica 0's: replica 1's share is cancelled
    assert len(tokens(replicas, PROMPTS)) == len(PROMPTS)
    assert replicas.stats().num_running == 0


def test_a_replica_that_dies_fails_the_call_naming_it(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), data_parallel_size=2, **SETTINGS)
    assert llm.replicas is not None
    try:
        llm.replicas.procs[0].kill()
        llm.replicas.procs[0].wait()
        with pytest.raises(RuntimeError, match="replica 1 exited"):
            tokens(llm, PROMPTS)
        with pytest.raises(RuntimeError, match="replica 1 exited"):  # and every call after
            tokens(llm, PROMPTS)
    finally:
        llm.replicas.stop()
