"""Offline data parallelism: `LLM(..., data_parallel_size=2)` deals a batch out to two engine
replicas (this process, and one of its own) and gives what one engine gives, in order."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kvflow import LLM, SamplingParams
from shared.protocol import ParameterError

PROMPTS = [[5, 9, 11, 40], [7] * 20, list(range(3, 40)), [1, 2, 3], [60] * 9]
SETTINGS = {"dtype": "float32", "device": "cpu", "max_model_len": 128}


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_llama_dir), data_parallel_size=2, **SETTINGS)
    yield llm
    llm.close()


def tokens(llm: LLM, prompts: list[list[int]], **params: object) -> list[list[list[int]]]:
    sampling = SamplingParams(max_tokens=10, ignore_eos=True, **params)
    return [[c.token_ids for c in r.outputs] for r in llm.generate(prompts, sampling)]


def prompt_tokens(llm: LLM) -> list[int]:
    return [s.num_prompt_tokens for s in llm.replica_stats()]


def test_two_replicas_give_one_engines_tokens_in_the_prompts_order(
    replicas: LLM, tiny_llama_dir: Path
) -> None:
    one = LLM(str(tiny_llama_dir), **SETTINGS)
    tokens(replicas, PROMPTS[:2])  # every replica has answered once: it has stats
    before = prompt_tokens(replicas)
    assert tokens(replicas, PROMPTS, temperature=0.0) == tokens(one, PROMPTS, temperature=0.0)
    # Seeded sampling, n completions each: every completion is its own, whichever replica.
    seeded = {"temperature": 1.0, "seed": 3, "n": 2}
    assert tokens(replicas, PROMPTS, **seeded) == tokens(one, PROMPTS, **seeded)
    stats = replicas.replica_stats()
    assert [s.replica for s in stats] == [0, 1]
    # Prompts 0, 2, 4 went to replica 0, and 1, 3 to replica 1: three times each (once
    # greedy, twice for n=2).
    counted = [a - b for a, b in zip(prompt_tokens(replicas), before, strict=True)]
    assert counted == [3 * (4 + 37 + 9), 3 * (20 + 3)]
    assert all(s.num_running == s.num_waiting == 0 for s in stats)


def test_unseeded_samples_differ_across_replicas(replicas: LLM) -> None:
    """Each replica draws its own random numbers: the same prompt six times gives six
    samples, not three drawn twice."""
    samples = tokens(replicas, [PROMPTS[2]] * 6, temperature=1.0)
    assert len({tuple(s[0]) for s in samples}) == 6


def generated(llm: LLM) -> int:
    return llm.replica_stats()[1].num_generation_tokens


def test_a_bad_prompt_in_any_share_fails_the_call_and_cancels_the_others(replicas: LLM) -> None:
    too_long = [5] * 200
    with pytest.raises(ParameterError, match="max_model_len is 128"):
        tokens(replicas, [PROMPTS[0], too_long, PROMPTS[1]])  # the second: replica 1's
    tokens(replicas, PROMPTS[:2])
    before = generated(replicas)
    # Replica 0's prompt is bad; replica 1's share (32 prompts of 100 tokens) is cancelled
    # long before it ends, and its late answer does not reach the next call.
    sampling = SamplingParams(max_tokens=100, ignore_eos=True)
    with pytest.raises(ParameterError, match="max_model_len is 128"):
        replicas.generate([too_long, [*PROMPTS[0], 1, 2, 3]] * 32, sampling)
    results = replicas.generate(PROMPTS, SamplingParams(max_tokens=4))
    assert [r.prompt_token_ids for r in results] == PROMPTS  # this call's, in order
    assert generated(replicas) - before < 32 * 100  # it stopped early
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
        llm.close()
    with pytest.raises(RuntimeError, match="stopped"):
        tokens(llm, PROMPTS)


def test_replicas_that_are_not_ready_in_time_are_stopped(tiny_llama_dir: Path) -> None:
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(RuntimeError, match="not ready after"):
        LLM(str(tiny_llama_dir), data_parallel_size=3, startup_timeout=0.01, **SETTINGS)
    assert set(psutil.Process().children(recursive=True)) <= before  # none of theirs is left
