"""The offline `LLM` API end to end on CPU: sampling through the engine, bad input, text."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from kvflow import LLM, SamplingParams
from shared.config import OFFLINE_DEFAULTS
from shared.protocol import ParameterError
from tests.integration.tiny_models import TINY_ENGINE

PROMPTS = [[5, 9, 11, 40], [7] * 20, list(range(3, 40))]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128)


def assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)
    llm.engine.scheduler.check_invariants()


def sample(llm: LLM, prompts: list[list[int]], **params: object) -> list[list[int]]:
    sampling = SamplingParams(max_tokens=12, ignore_eos=True, **params)
    return [r.token_ids for r in llm.generate(prompts, sampling)]


def test_seeded_sampling_reproduces_whatever_the_batch(tiny: LLM) -> None:
    alone = sample(tiny, PROMPTS[:1], temperature=1.0, seed=7)
    batched = sample(tiny, PROMPTS, temperature=1.0, seed=7)
    assert batched[0] == alone[0]
    assert sample(tiny, PROMPTS[:1], temperature=1.0, seed=8) != alone
    assert_idle(tiny)


def test_top_k_one_is_greedy(tiny: LLM) -> None:
    assert sample(tiny, PROMPTS, temperature=1.0, top_k=1) == sample(tiny, PROMPTS, temperature=0)


def test_n_completions_share_the_prompt_and_differ(tiny: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    [result] = tiny.generate(PROMPTS[1:2], params)
    assert [c.index for c in result.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in result.outputs}) == 3
    assert_idle(tiny)


def test_a_run_holds_the_heap_frozen_and_thaws_it(
    tiny: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No full collection walks the engine's startup objects mid-run (shared/gc_heap.py);
    after the run the collector sees them again, so a dropped engine can be collected."""
    frozen_while_stepping: list[int] = []
    step_until_done = tiny._step_until_done

    def stepping(*args: object) -> None:
        frozen_while_stepping.append(gc.get_freeze_count())
        step_until_done(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(tiny, "_step_until_done", stepping)
    gc.unfreeze()  # as a process that froze nothing of its own
    assert len(sample(tiny, PROMPTS[:1])) == 1
    assert frozen_while_stepping[0] > 0
    assert gc.get_freeze_count() == 0


def test_a_batch_larger_than_the_serving_queue_limit_runs(tiny_llama_dir: Path) -> None:
    """Offline, the whole batch waits at once: --max-queued-requests is a serving limit."""
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=128, max_queued_requests=1)
    assert len(sample(llm, PROMPTS)) == len(PROMPTS)


def test_offline_steps_default_to_the_offline_budget(tiny: LLM, tiny_llama_dir: Path) -> None:
    """LLM plans larger steps than a server by default (OFFLINE_DEFAULTS), unless told."""
    offline = OFFLINE_DEFAULTS["max_num_batched_tokens"]
    assert tiny.engine.scheduler.config.max_num_batched_tokens == offline
    assert tiny.runner.max_num_batched_tokens == offline
    small = LLM(str(tiny_llama_dir), device="cpu", max_model_len=128, max_num_batched_tokens=16)
    assert small.engine.scheduler.config.max_num_batched_tokens == 16
    greedy = sample(tiny, PROMPTS, temperature=0)
    assert sample(small, PROMPTS, temperature=0) == greedy  # chunked, the same tokens


def test_chat_messages_need_a_role_and_text(tiny: LLM) -> None:
    with pytest.raises(ParameterError) as error:
        tiny.chat([[{"role": "user"}]])
    assert error.value.param == "messages"


def test_logprobs_are_returned_per_token(tiny: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    [result] = tiny.generate(PROMPTS[:1], params)
    assert len(result.outputs[0].logprobs) == 5
    for token_id, lp in zip(result.token_ids, result.outputs[0].logprobs, strict=True):
        assert lp.token_id == token_id and lp.rank == 1  # greedy picks the top token
        assert lp.top[0].token_id == token_id and len(lp.top) == 3
        assert lp.logprob == pytest.approx(lp.top[0].logprob) and lp.logprob <= 0.0


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], {}, "prompt"),
        ([5] * 128, {}, "prompt"),
        ([5] * 100, {"max_tokens": 50}, "max_tokens"),
        ([5, 6], {"max_tokens": 0}, "max_tokens"),
        ([5, 6], {"temperature": -0.5}, "temperature"),
        ([5, 6], {"top_p": 0.0}, "top_p"),
        ([5, 6], {"top_p": 1.5}, "top_p"),
        ([5, 6], {"top_k": 0}, "top_k"),
        ([5, 999], {}, "prompt"),
    ],
)
def test_bad_input_raises_naming_the_parameter(
    tiny: LLM, prompt: list[int], params: dict, param: str
) -> None:
    with pytest.raises(ParameterError) as error:
        tiny.generate([[1, 2, 3], prompt], SamplingParams(**params))
    assert error.value.param == param
    assert param in str(error.value)
    assert_idle(tiny)  # the valid request of the batch was withdrawn too
    assert len(sample(tiny, PROMPTS[:1])[0]) == 12  # and the engine still serves


def test_text_prompt_stop_string_and_chat(smollm2: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    [plain] = smollm2.generate("The capital of France is", greedy)
    assert plain.text.startswith(" Paris")
    stop = SamplingParams(temperature=0.0, max_tokens=16, stop=["."])
    [stopped] = smollm2.generate("The capital of France is", stop)
    assert (stopped.text, stopped.finish_reason) == (" Paris", "stop")
    [reply] = smollm2.chat(
        [[{"role": "user", "content": "What is the capital of France?"}]],
        SamplingParams(temperature=0.0, max_tokens=32),
    )
    assert "Paris" in reply.text
    assert reply.finish_reason in ("stop", "length")
    assert_idle(smollm2)


def test_sharded_checkpoint_and_half_precision(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # several files + an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    reference = sample(LLM(str(tiny_llama_dir), device="cpu"), PROMPTS, temperature=0)
    assert sample(LLM(str(tmp_path), device="cpu"), PROMPTS, temperature=0) == reference
    for dtype in ("bfloat16", "float16"):
        half = LLM(str(tmp_path), device="cpu", dtype=dtype)
        assert half.runner.kv_caches[0].dtype == getattr(torch, dtype)
        tokens = sample(half, PROMPTS, temperature=0)
        # Rounding may change late tokens, but the first ones have clear margins.
        assert [t[:2] for t in tokens] == [t[:2] for t in reference]


def test_a_closed_llm_takes_no_more_calls(tiny_llama_dir: Path) -> None:
    """close() stops what an LLM started (replicas, ranks): a call after it is refused by
    name, rather than failing somewhere in a stopped group."""
    llm = LLM(str(tiny_llama_dir), max_model_len=128, **TINY_ENGINE)
    assert sample(llm, PROMPTS[:1], temperature=0)
    llm.close()
    with pytest.raises(RuntimeError, match="this LLM was closed"):
        sample(llm, PROMPTS[:1], temperature=0)
