"""The start-up warm-up steps (run on GPUs) run on any device, leave no request state behind,
and change nothing a later request computes (their KV blocks are never read)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kvflow import LLM, SamplingParams
from services.executor.layers.linear import Linear
from services.executor.layers.moe import SparseMoE
from services.executor.runner.warm_up import (
    blocks_needed,
    eager_lengths,
    first_step_lengths,
    many_request_steps,
    skip_reason,
    warm_up,
)
from tests.integration.tiny_models import FAMILIES, MOE_FAMILIES, TINY

PROMPTS = [[5, 9, 2, 7, 1, 3], [4, 4, 8, 2, 6, 1, 9, 3, 3, 7, 2, 5, 8, 1, 6, 2, 4, 9]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def make_llm(folder: Path, **limits: int) -> LLM:
    # By default a budget past the largest mixed graph, so the eager warm-up steps run too.
    limits = {"max_model_len": 1024, "max_num_batched_tokens": 1024, **limits}
    return LLM(str(folder), dtype="float32", device="cpu", **limits)


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3-long")
    config_cls, extra = FAMILIES["qwen3"]
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **extra, "max_position_embeddings": 2048})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_warm_up_leaves_nothing_behind(long_context_dir: Path) -> None:
    cold = make_llm(long_context_dir, num_gpu_blocks_override=256)
    expected = [r.outputs[0].token_ids for r in cold.generate(PROMPTS, PARAMS)]

    llm = make_llm(long_context_dir, num_gpu_blocks_override=256)
    assert eager_lengths(llm.runner) == [531, 1008]
    assert blocks_needed(llm.runner) <= llm.runner.num_blocks
    warm_up(llm.runner)
    assert llm.runner.requests == {}
    got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, PARAMS)]
    assert got == expected


def test_warm_up_runs_the_linear_layers_at_the_larger_row_tiles(long_context_dir: Path) -> None:
    """Without CUDA graphs (as on the CPU) the first layer's projections and the lm_head run at
    12, 24 and 48 rows: the FP8 GEMV's 16-row tile and both GEMVs' 32- and 64-row tiles, so
    eager decode batches of 9-64 rows compile nothing."""
    llm = make_llm(long_context_dir, num_gpu_blocks_override=256)
    seen: list[tuple[str, int]] = []
    hooks = [
        module.register_forward_hook(
            lambda _module, args, _out, name=name: seen.append((name, args[0].shape[0]))
        )
        for name, module in llm.runner.model.named_modules()
        if isinstance(module, Linear)
    ]
    warm_up(llm.runner)
    for hook in hooks:
        hook.remove()
    first_layer = {f"layers.0.{n}" for n in LAYER_LINEARS}
    for rows in (12, 24, 48):
        assert {name for name, r in seen if r == rows} == first_layer | {"lm_head"}


def test_warm_up_fits_a_small_budget(long_context_dir: Path) -> None:
    """The first step (three prompts at once) shrinks to the token budget and the context."""
    llm = make_llm(
        long_context_dir, max_model_len=64, max_num_batched_tokens=48, num_gpu_blocks_override=64
    )
    lengths = first_step_lengths(llm.runner)
    assert sum(lengths) <= 48 and max(lengths) <= 64 - 4
    assert eager_lengths(llm.runner) == []
    warm_up(llm.runner)
    assert llm.runner.requests == {}


@pytest.mark.parametrize(
    ("limits", "reason"),
    [
        (dict(max_num_seqs=2), "--max-num-seqs"),
        (dict(max_num_batched_tokens=4), "--max-num-batched-tokens"),
    ],
)
def test_warm_up_skips_limits_it_does_not_fit(
    long_context_dir: Path, limits: dict[str, int], reason: str
) -> None:
    llm = make_llm(long_context_dir, max_model_len=64, **limits)
    assert reason in (skip_reason(llm.runner) or "")
    warm_up(llm.runner)  # logs and returns
    assert llm.runner.requests == {}


def test_warm_up_steps_past_256_requests_leave_nothing_behind(long_context_dir: Path) -> None:
    """--max-num-seqs 600: eager mixed steps of 257 and 513 requests, the prefill kernel's two
    variants past 256 requests, each with rows free for it; then the same tokens as cold."""
    limits = dict(max_num_seqs=600, max_num_batched_tokens=1100, num_gpu_blocks_override=1024)
    cold = make_llm(long_context_dir, **limits)
    expected = [r.outputs[0].token_ids for r in cold.generate(PROMPTS, PARAMS)]

    llm = make_llm(long_context_dir, **limits)
    assert many_request_steps(llm.runner) == [257, 513]
    default = make_llm(long_context_dir, max_num_batched_tokens=1100)  # 256 sequences
    assert many_request_steps(default.runner) == []
    rows: list[int] = []
    hook = llm.runner.model.lm_head.register_forward_hook(
        lambda _module, args, _out: rows.append(args[0].shape[0])
    )
    warm_up(llm.runner)
    hook.remove()
    assert 257 in rows and 513 in rows  # every request of those steps samples
    assert llm.runner.requests == {}
    got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, PARAMS)]
    assert got == expected


def test_a_step_of_many_requests_that_the_cache_cannot_hold_is_skipped_alone(
    long_context_dir: Path,
) -> None:
    """300 blocks hold the first steps (112 blocks) and, reusing them, the step of 257 requests
    (289 blocks), but not the step of 513 (545): that step alone is left out."""
    limits = dict(max_num_seqs=600, max_num_batched_tokens=1100, num_gpu_blocks_override=300)
    llm = make_llm(long_context_dir, **limits)
    assert skip_reason(llm.runner) is None
    assert blocks_needed(llm.runner) == 112
    assert many_request_steps(llm.runner) == [257]
    rows: list[int] = []
    hook = llm.runner.model.lm_head.register_forward_hook(
        lambda _module, args, _out: rows.append(args[0].shape[0])
    )
    warm_up(llm.runner)
    hook.remove()
    assert 257 in rows and 513 not in rows
    assert llm.runner.requests == {}


@pytest.mark.parametrize("family", ["gemma2", "qwen2 sliding", "phi3 longrope"])
def test_warm_up_of_layer_groups_and_longrope_leaves_nothing_behind(
    tmp_path: Path, family: str
) -> None:
    """Layer groups (a block of each group for every token: step_state.py) and LongRoPE's
    two rotary sets (its warm-up prompts cross the original context) warm up too."""
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **extra, "max_position_embeddings": 2048})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    cold = make_llm(tmp_path, num_gpu_blocks_override=512)
    expected = [r.outputs[0].token_ids for r in cold.generate(PROMPTS, PARAMS)]
    llm = make_llm(tmp_path, num_gpu_blocks_override=512)
    assert blocks_needed(llm.runner) <= llm.runner.num_blocks
    warm_up(llm.runner)
    assert llm.runner.requests == {}
    assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, PARAMS)] == expected


def test_warm_up_runs_the_first_experts_at_one_token_and_counts_no_load(tmp_path: Path) -> None:
    """Without CUDA graphs the first mixture of experts also runs at one token (its GEMVs,
    which the warm-up's 3-row decodes pass by with FP8 experts), on a padding row: the expert
    load stays as the steps left it."""
    config_cls, extra = MOE_FAMILIES["qwen3_moe dense first"]
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **extra, "max_position_embeddings": 2048})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    llm = make_llm(tmp_path, num_gpu_blocks_override=256)
    moes = [m for m in llm.runner.model.modules() if isinstance(m, SparseMoE)]
    rows: list[tuple[int, int]] = []
    hooks = [
        moe.register_forward_hook(
            lambda _module, args, _out, index=index: rows.append((index, args[0].shape[0]))
        )
        for index, moe in enumerate(moes)
    ]
    counts = torch.zeros(moes[0].moe.num_experts, dtype=torch.int64)
    moes[0].counts_into(counts)
    warm_up(llm.runner)
    for hook in hooks:
        hook.remove()
    steps = [r for i, r in rows if i == 0]
    assert steps.count(1) == 1 and 1 not in [r for i, r in rows if i > 0]
    top_k = moes[0].moe.top_k  # each of the steps' tokens chose top_k experts, the padding none
    assert counts.sum().item() == top_k * sum(r for r in steps if r != 1)
