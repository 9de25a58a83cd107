"""Mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE): which layers have experts, the
kernels' references against a token-by-token recomputation, and what is not built yet refused
by name.
Greedy parity with transformers is test_parity's, for these families as for the dense ones, and
on two ranks test_tensor_parallel's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from kernels.moe import moe_experts_reference, moe_route_reference
from kvflow import LLM, SamplingParams
from services.executor.layers.moe import SparseMoE
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.parallel.tensor_parallel import TensorParallel
from services.executor.quantization.gguf import GgufBlocks
from services.executor.quantization.methods import experts_method
from services.executor.runner.expert_load import ExpertLoad
from services.frontend.metrics.prometheus import Metrics
from shared.model_config import ModelConfig, load_model_config, resolve_model_source
from tests.integration.tiny_models import MOE_FAMILIES, TINY, TINY_ENGINE
from tests.unit.snapshots import stats


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def tiny_moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(family, folder) of a tiny random mixture of experts. Its greedy output against
    transformers' is test_parity's (PARITY_FAMILIES)."""
    config_cls, extra = MOE_FAMILIES[request.param]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**{**TINY, **extra}))
    folder = tmp_path_factory.mktemp(request.param.replace(" ", "_"))
    model.save_pretrained(folder)
    return request.param, Path(folder)


def test_the_layers_with_experts_follow_the_config(tiny_moe) -> None:
    family, folder = tiny_moe
    moe = load_model_config(resolve_model_source(str(folder))).moe
    assert moe is not None and moe.sparse_layers == ((1,) if "dense" in family else (0, 1))
    llm = LLM(str(folder), **TINY_ENGINE)
    layers = llm.runner.model.layers
    assert [isinstance(layer.mlp, SparseMoE) for layer in layers] == [
        i in moe.sparse_layers for i in range(len(layers))
    ]


def test_the_experts_reference_is_each_tokens_weighted_sum() -> None:
    """Token by token: the chosen experts' gated MLPs, weighted by the routing."""
    generator = torch.Generator().manual_seed(0)
    tokens, hidden, experts, columns, top_k = 7, 16, 5, 12, 2
    x = torch.randn(tokens, hidden, generator=generator)
    gate_up = torch.randn(experts, 2 * columns, hidden, generator=generator)
    down = torch.randn(experts, hidden, columns, generator=generator)
    logits = torch.randn(tokens, experts, generator=generator)
    for renormalize in (False, True):
        weights, ids = moe_route_reference(logits, top_k, renormalize)
        probs = logits.softmax(-1)
        for t in range(tokens):
            chosen = probs[t].argsort(descending=True)[:top_k]
            assert ids[t].tolist() == chosen.tolist()
            share = probs[t, chosen] / (probs[t, chosen].sum() if renormalize else 1)
            torch.testing.assert_close(weights[t], share)
        out = moe_experts_reference(x, gate_up, down, weights, ids)
        for t in range(tokens):
            expected = sum(
                w * down[e] @ (F.silu(gate_up[e, :columns] @ x[t]) * (gate_up[e, columns:] @ x[t]))
                for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True)
            )
            torch.testing.assert_close(out[t], expected, rtol=1e-4, atol=1e-4)


def test_what_experts_do_not_run_with_yet_is_refused(tiny_moe) -> None:
    _, folder = tiny_moe
    with pytest.raises(ValueError, match="gguf experts are not supported yet"):
        experts_method(GgufBlocks())
    config = load_model_config(resolve_model_source(str(folder)))
    assert config.moe is not None
    odd = dataclasses.replace(config, moe=dataclasses.replace(config.moe, intermediate_size=30))
    with pytest.raises(ValueError, match="30 columns of each expert do not split 4 ways"):
        DecoderForCausalLM(odd, 64, tp=TensorParallel(rank=0, size=4))
    if config.qk_norm_whole:
        with pytest.raises(ValueError, match="norms over all heads at once"):
            DecoderForCausalLM(config, 64, tp=TensorParallel(rank=0, size=2))


def test_a_steps_weight_bytes_count_the_experts_its_tokens_choose(tiny_moe) -> None:
    """`kvflow bench latency`'s floor: the dense weights, and of each layer's experts the
    share an even router picks for the batch, 1 - (1 - k / E) ** batch."""
    from benchmarks.engine_bench import _matmul_weight_bytes, _step_weight_bytes

    _, folder = tiny_moe
    model = LLM(str(folder), **TINY_ENGINE).runner.model
    moe = model.config.moe
    expert_bytes = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts_" in n
    )
    total = _matmul_weight_bytes(model)
    for batch in (1, 4):
        share = 1 - (1 - moe.top_k / moe.num_experts) ** batch
        assert _step_weight_bytes(model, batch) == total - expert_bytes + round(
            expert_bytes * share
        )
    assert _step_weight_bytes(model, 10_000) == total  # every expert chosen


def test_each_experts_load_is_counted_and_shown_in_the_metrics(tiny_moe) -> None:
    """Every layer's k choices of every token the model runs (a prompt's, then each decoded
    one's) count once; the scheduler keeps the newest read and /metrics shows it by expert."""
    _, folder = tiny_moe
    llm = LLM(str(folder), **TINY_ENGINE)
    model = llm.runner.model
    moe = model.config.moe
    load = ExpertLoad(model, interval_s=0.0)  # zeroes the counts
    assert load.read() == ([0] * moe.num_experts, [-1] * moe.num_experts)
    prompt, new = [5, 9, 11, 200, 31, 7, 8], 6
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    counts, ranks = load.read()
    tokens_run = len(prompt) + new - 1  # the last token sampled is not run
    assert sum(counts) == moe.top_k * len(moe.sparse_layers) * tokens_run
    assert ExpertLoad(model, interval_s=60.0).read() == ([0] * moe.num_experts, ranks)
    snapshot = stats(expert_tokens=counts, expert_ranks=ranks)
    text = Metrics("m").render([snapshot], num_tokenizer_workers=1, num_in_flight=0)
    line = 'kvflow:moe_expert_tokens_total{model_name="m",replica="0",expert="1",rank="all"}'
    assert f"{line} {counts[1]}" in text


def two_rank_config(folder: Path) -> ModelConfig | None:
    """A tiny mixture of experts' config, or None for OLMoE, which runs on one rank."""
    config = load_model_config(resolve_model_source(str(folder)))
    assert config.moe is not None
    return None if config.qk_norm_whole else config


def test_expert_parallel_ranks_hold_runs_of_whole_experts(tiny_moe) -> None:
    config = two_rank_config(tiny_moe[1])
    if config is None or config.moe is None:
        return
    total = config.moe.num_experts
    models = [
        DecoderForCausalLM(config, 64, tp=TensorParallel(rank, 2, expert_parallel=True))
        for rank in range(2)
    ]
    held = [m.layers[-1].mlp.experts_down.shape[0] for m in models]
    assert held == [total // 2, total - total // 2]
    assert models[0].layers[-1].mlp.experts_down.shape[2] == config.moe.intermediate_size  # whole
    assert models[1].expert_ranks() == [0] * (total // 2) + [1] * (total - total // 2)
    few = dataclasses.replace(config, moe=dataclasses.replace(config.moe, num_experts=1))
    with pytest.raises(ValueError, match="1 experts are fewer than the 2 ranks"):
        DecoderForCausalLM(few, 64, tp=TensorParallel(0, 2, expert_parallel=True))


@pytest.mark.slow
def test_gpt_oss_mxfp4_checkpoints_keep_their_experts_mxfp4(tmp_path: Path) -> None:
    """gpt-oss as published (its experts MXFP4): greedy tokens of transformers on the weights
    the checkpoint stands for, with the experts kept MXFP4 (packed codes and power-of-two
    scales; kernels/moe.py's reference on the CPU, where --quantization mxfp4 asks for them)
    and, without it on the CPU, dequantized at load; by --quantization fp8, FP8 experts."""
    from tests.integration.test_parity import hf_greedy, kvflow_greedy
    from tests.integration.tiny_models import make_prompts
    from tests.quantized_writers import write_mxfp4_gpt_oss

    config_cls, extra = MOE_FAMILIES["gpt_oss"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**{**TINY, **extra}))
    prompts = make_prompts(model.config.vocab_size)
    plain = hf_greedy(model, prompts, eos_token_id=None)
    write_mxfp4_gpt_oss(model, tmp_path)
    expected = hf_greedy(model, prompts, eos_token_id=None)
    assert expected != plain  # the rounding to MXFP4 changes the output
    llm = LLM(str(tmp_path), **TINY_ENGINE, quantization="mxfp4")
    assert kvflow_greedy(llm, prompts, ignore_eos=True) == expected
    mlp = llm.runner.model.layers[0].mlp
    assert mlp.method.name == "mxfp4" and mlp.experts_gate_up.dtype == torch.int32
    assert mlp.experts_gate_up_scale.dtype == torch.bfloat16
    dequantized = LLM(str(tmp_path), **TINY_ENGINE)
    assert kvflow_greedy(dequantized, prompts, ignore_eos=True) == expected
    assert dequantized.runner.model.layers[0].mlp.experts_gate_up.dtype == torch.float32
    fp8 = LLM(str(tmp_path), **TINY_ENGINE, quantization="fp8")
    assert fp8.runner.model.layers[0].mlp.method.name == "fp8"


def test_mxfp4_dummy_experts_run_for_gpt_oss_and_are_refused_elsewhere(
    tiny_moe, tiny_llama_dir: Path
) -> None:
    """--quantization mxfp4 with --load-format dummy (speed runs, as vLLM's on gpt-oss's
    folders): random MXFP4 experts that generate; on other experts, or none, it is refused
    rather than quantizing nothing."""
    family, folder = tiny_moe
    settings = dict(**TINY_ENGINE, load_format="dummy", quantization="mxfp4")
    if family != "gpt_oss":
        with pytest.raises(ValueError, match="MXFP4 experts are gpt-oss's"):
            LLM(str(folder), **settings)
        return
    llm = LLM(str(folder), **settings)
    assert llm.runner.model.layers[0].mlp.experts_down.dtype == torch.int32
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]], params)[0].token_ids) == 4
    with pytest.raises(ValueError, match="is for gpt-oss's experts; llama has none"):
        LLM(str(tiny_llama_dir), **settings)


def test_bench_throughput_counts_every_choice_of_the_timed_run(tiny_moe, tmp_path: Path) -> None:
    """`kvflow bench throughput`'s expert load: each token the timed run computes makes top-k
    choices in every layer with experts (the warm-up's are not counted)."""
    from services.launcher.cli import main

    _, folder = tiny_moe
    out = tmp_path / "throughput.json"
    args = ["bench", "throughput", str(folder), "--device", "cpu", "--dtype", "float32"]
    args += ["--num-prompts", "3", "--input-len", "7", "--output-len", "5", "--ignore-eos"]
    assert main([*args, "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    load = report["expert_load"]
    assert len(report["gc_in_timed_run"]["count_by_generation"]) == 3  # the collector's, too
    config = load_model_config(resolve_model_source(str(folder)))
    assert config.moe is not None
    tokens_run = 3 * (7 + 5 - 1)  # the last token sampled is not run
    assert sum(load["per_expert"]) == tokens_run * len(config.moe.sparse_layers) * config.moe.top_k
    assert "per_rank" not in load  # one rank holds a part of every expert


def test_expert_load_adds_up_each_ranks_experts(tiny_moe) -> None:
    from benchmarks.engine_bench import expert_load

    config = two_rank_config(tiny_moe[1])
    if config is None or config.moe is None:
        return
    model = DecoderForCausalLM(config, 64, tp=TensorParallel(0, 2, expert_parallel=True))
    assert model.expert_tokens is not None
    total = config.moe.num_experts
    model.expert_tokens.copy_(torch.arange(total))
    load = expert_load(model)
    half = total // 2
    assert load["per_rank"] == [sum(range(half)), sum(range(half, total))]
    even = sum(range(total)) / 2
    assert load["busiest_rank_over_even"] == round(sum(range(half, total)) / even, 3)
