"""`--batch-invariant` on the CPU: the engine runs with it, and refuses it by name where its
kernels do not cover the model (kernels/invariance.py; tests/kernels/test_batch_invariance.py
holds the kernels to it, test_gpu_speculative.py the engine on a GPU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kernels import invariance
from kvflow import LLM, SamplingParams

PROMPTS = [[5, 9, 11, 40], list(range(3, 40))]
SETTINGS = dict(dtype="float32", device="cpu", max_model_len=128)


@pytest.fixture(autouse=True)
def switched_off_after() -> Iterator[None]:
    """The switch is per process, and these engines run in this one."""
    yield
    invariance.set_batch_invariant(False)


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [r.token_ids for r in llm.generate(PROMPTS, params)]


def test_the_engine_runs_invariant_with_the_same_greedy_tokens(tiny_llama_dir: Path) -> None:
    plain = greedy(LLM(str(tiny_llama_dir), **SETTINGS))
    llm = LLM(str(tiny_llama_dir), batch_invariant=True, **SETTINGS)
    assert invariance.batch_invariant(16) and not invariance.batch_invariant(17)
    assert greedy(llm) == plain


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        (dict(quantization="fp8"), "unquantized layers only"),
        (dict(enable_lora=True), "no LoRA adapters yet"),
        (dict(kv_cache_dtype="fp8"), "not fp8"),
    ],
)
def test_what_it_does_not_cover_is_refused_by_name(
    tiny_llama_dir: Path, settings: dict, reason: str
) -> None:
    with pytest.raises(ValueError, match=f"--batch-invariant covers .*{reason}"):
        LLM(str(tiny_llama_dir), batch_invariant=True, **{**SETTINGS, **settings})
    assert not invariance.batch_invariant(1)
