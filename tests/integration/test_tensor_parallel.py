"""Tensor parallelism on CPU over gloo: `kvflow.LLM` on N ranks, processes each with its part
of every layer (services/executor/parallel/tensor_parallel.py) that run the plans rank 0 relays
(services/executor/rank_group.py), gives the greedy tokens of one process, and of
transformers, for the tiny parity models (Llama and Qwen3, Llama with one KV head that every
rank holds, and three mixtures of experts, each expert split by its columns) at 2 ranks and
the embedded SmolLM2 (9 query and 3 KV heads) at 3, also with LoRA adapters (peft's tokens);
a split the model does not allow is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers

from kvflow import LLM, SamplingParams
from services.executor.parallel.layout import ShardLayout
from services.executor.parallel.tensor_parallel import TensorParallel
from shared.model_config import load_model_config, resolve_model_source
from tests.integration.test_eagle3 import NUM_LAYERS, write_head
from tests.integration.test_parity import hf_greedy
from tests.integration.tiny_models import FAMILIES, MOE_FAMILIES, TINY, make_prompts
from tests.integration.tp_generate import generate, job_results, make_job, run_jobs, spec_counts

NUM_TOKENS = 24


def greedy(
    tmp_path: Path, world: int, model: str | None, prompts: list[list[int]], **config: object
) -> list[list[int]]:
    """Greedy tokens from `kvflow.LLM` on `world` ranks (one process each, in one gloo group)."""
    return [tokens for tokens, _ in generate(tmp_path, world, model, prompts, NUM_TOKENS, **config)]


Cases = dict[str, tuple[list[list[int]], Path]]  # case: expected tokens, its job's folder


def run_cases(
    base: Path, models: dict[str, tuple[Path, torch.nn.Module, int]], **config: object
) -> Cases:
    """For each case (a model's folder, the model, its ranks): transformers' greedy tokens,
    and the folder of its job's results. The jobs run in turn in one process: one start-up
    (imports, some 2 s) for them all, each `LLM` closed before the next starts its group (one
    that `close` left behind would refuse the next)."""
    prompts = make_prompts(TINY["vocab_size"])[:4]
    expected, jobs = {}, {}
    for name, (folder, model, world) in models.items():
        expected[name] = hf_greedy(model, prompts, NUM_TOKENS, eos_token_id=None)
        jobs[base / name / "job"] = make_job(world, str(folder), prompts, NUM_TOKENS, **config)
    run_jobs(jobs)
    return {name: (expected[name], base / name / "job") for name in models}


def tiny_cases(
    base: Path, cases: dict[str, tuple[str, int, dict]]
) -> dict[str, tuple[Path, torch.nn.Module, int]]:
    """For each case (a family, its ranks, changes to its tiny model): its tiny model's
    folder, the model, and its ranks."""
    models = {}
    for name, (family, world, changes) in cases.items():
        models[name] = (*tiny_folder(base / name, family, **changes), world)
    return models


def tokens_of(folder: Path) -> list[list[int]]:
    """The tokens of the job run in `folder`."""
    return [tokens for tokens, _ in job_results(folder)]


def tiny_folder(
    tmp_path: Path, family: str, **changes: object
) -> tuple[Path, transformers.PreTrainedModel]:
    config_cls, extra = {**FAMILIES, **MOE_FAMILIES}[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**{**TINY, **extra, **changes}), dtype=torch.float32
    ).eval()
    with torch.no_grad():  # random norms and biases, as the parity tests have them
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.2)
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model", model


TWO_RANKS = {  # case: family, ranks, changes to its tiny model
    "llama": ("llama", 2, {}),
    "qwen2-biases-tied": ("qwen2", 2, {}),
    "qwen3": ("qwen3", 2, {}),
    "granite-multipliers": ("granite", 2, {}),
    "phi3-fused-checkpoint-window": ("phi3", 2, {}),
    "gemma3-sandwich-norms-two-rotaries": ("gemma3_text", 2, {}),
    "gemma2-soft-caps": ("gemma2", 2, {}),
    "llama-one-kv-head": ("llama", 2, {"num_key_value_heads": 1}),
    "qwen3-moe-dense-first": ("qwen3_moe dense first", 2, {}),
    "qwen2-moe-shared-expert": ("qwen2_moe", 2, {}),
    "mixtral": ("mixtral", 2, {}),
    "gpt-oss-sinks-biases-fused-experts": ("gpt_oss", 2, {}),
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Cases:
    base = tmp_path_factory.mktemp("two-ranks")
    return run_cases(base, tiny_cases(base, TWO_RANKS))


@pytest.mark.parametrize("case", TWO_RANKS)
def test_two_ranks_give_the_tokens_of_one(two_ranks: Cases, case: str) -> None:
    expected, folder = two_ranks[case]
    assert tokens_of(folder) == expected, case


def test_two_ranks_split_gpt_oss_mxfp4_experts_by_whole_groups(tmp_path: Path) -> None:
    """gpt-oss as published, its experts MXFP4 and kept so: each rank holds half of every
    expert's gate and up rows (de-interleaved) and of down's groups of 32 input columns."""
    from tests.quantized_writers import write_mxfp4_gpt_oss

    _, model = tiny_folder(tmp_path, "gpt_oss", intermediate_size=64)  # two groups
    write_mxfp4_gpt_oss(model, tmp_path / "mxfp4")
    prompts = make_prompts(TINY["vocab_size"])[:4]
    expected = hf_greedy(model, prompts, NUM_TOKENS, eos_token_id=None)
    tokens = greedy(tmp_path, 2, str(tmp_path / "mxfp4"), prompts, quantization="mxfp4")
    assert tokens == expected


THREE_WAYS = {"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 96}


EXPERT_PARALLEL = {  # case: family, ranks, changes to its tiny model
    "one-rank": ("qwen3_moe", 1, {}),
    "qwen3-moe-three-ranks": ("qwen3_moe", 3, THREE_WAYS),
    "qwen2-moe-shared-expert": ("qwen2_moe", 2, {}),
    "mixtral": ("mixtral", 2, {}),
    "gpt-oss": ("gpt_oss", 2, {}),
}


@pytest.fixture(scope="module")
def expert_parallel(tmp_path_factory: pytest.TempPathFactory) -> Cases:
    base = tmp_path_factory.mktemp("expert-parallel")
    return run_cases(base, tiny_cases(base, EXPERT_PARALLEL), enable_expert_parallel=True)


@pytest.mark.parametrize("case", EXPERT_PARALLEL)
def test_expert_parallel_ranks_give_the_tokens_of_one(expert_parallel: Cases, case: str) -> None:
    """--enable-expert-parallel: each rank holds its run of the experts whole (three ranks:
    2, 3 and 3 of Qwen3-MoE's 8), attention and the shared expert split as without it."""
    expected, folder = expert_parallel[case]
    assert tokens_of(folder) == expected, case


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_two_ranks_verify_drafts_and_give_the_tokens_of_one(tmp_path: Path, method: str) -> None:
    """Speculative decoding over two ranks: each rank verifies the drafts rank 0 relays in
    the plan (prompts that repeat themselves, so n-gram drafts are made; a draft model, the
    target itself whole on rank 0, drafts everywhere; an EAGLE-3 head, whole on rank 0 with
    the target's embedding gathered whole, drafts as on one rank, draft for draft)."""
    layers = {"num_hidden_layers": NUM_LAYERS} if method == "eagle3" else {}  # the head reads 3
    folder, model = tiny_folder(tmp_path, "llama", **layers)
    first, second = make_prompts(TINY["vocab_size"])[:2]
    prompts = [first[:6] * 4, second]
    expected = hf_greedy(model, prompts, NUM_TOKENS, eos_token_id=None)
    spec: dict[str, object] = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec["prompt_lookup_min"] = 1
    elif method == "draft_model":
        spec["model"] = str(folder)
    else:  # a random head drafting the target's most frequent tokens: some are accepted
        counts = Counter(token for output in expected for token in output)
        draft_ids = sorted(token for token, _ in counts.most_common(24))
        config = transformers.AutoConfig.from_pretrained(folder)
        spec["model"] = str(write_head(tmp_path / "head", config, draft_ids))
    worlds = {"two": 2, "one": 1} if method == "eagle3" else {"two": 2}
    jobs = {
        tmp_path / name: make_job(world, str(folder), prompts, NUM_TOKENS, speculative_config=spec)
        for name, world in worlds.items()
    }
    run_jobs(jobs)  # in one process
    for out in jobs:
        assert tokens_of(out) == expected, out.name
    if method == "eagle3":
        one, two = spec_counts(tmp_path / "one"), spec_counts(tmp_path / "two")
        assert 0 < two["accepted"] < two["drafts"]
        assert two["proposals"] == one["proposals"]  # draft for draft


SMOLLM2_PROMPTS = [[1, 504, 3458, 282, 4649, 314], [28, 1171, 2424, 30, 216, 9123]]
SMOLLM2_TOKENS = 12  # SmolLM2 on three CPU processes (suite time)
SMOLLM2_QUANTIZATIONS = {"dequantized": None, "gguf-blocks": "gguf"}


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The folder of SmolLM2's job on three ranks by quantization, the jobs in one process."""
    base = tmp_path_factory.mktemp("three-ranks")
    jobs = {
        base / name: make_job(3, None, SMOLLM2_PROMPTS, SMOLLM2_TOKENS, quantization=quantization)
        for name, quantization in SMOLLM2_QUANTIZATIONS.items()
    }
    run_jobs(jobs)
    return {out.name: out for out in jobs}


@pytest.mark.parametrize("quantization", SMOLLM2_QUANTIZATIONS)
def test_the_embedded_model_on_three_ranks(
    three_ranks: dict[str, Path], quantization: str, request: pytest.FixtureRequest
) -> None:
    """SmolLM2's Q4_1 GGUF, dequantized at load or kept in its blocks (each rank cutting whole
    blocks of o_proj's and down_proj's input columns)."""
    # One process: the session's SmolLM2 (CPU, float32, dequantized at load): a rank keeping the
    # blocks dequantizes them to the same float32 weights each step, so its tokens are these.
    smollm2: LLM = request.getfixturevalue("smollm2")
    params = SamplingParams(temperature=0.0, max_tokens=SMOLLM2_TOKENS, ignore_eos=True)
    one = [result.token_ids for result in smollm2.generate(SMOLLM2_PROMPTS, params)]
    assert tokens_of(three_ranks[quantization]) == one, quantization


@pytest.mark.parametrize("changes", [{}, {"num_key_value_heads": 1}], ids=["llama", "one-kv-head"])
def test_lora_adapters_on_two_ranks_give_pefts_tokens(tmp_path: Path, changes: dict) -> None:
    """One batch mixing the base model and two adapters (every projection; q and v alone at
    another rank): each rank holds its part of each adapter, and the tokens are what
    transformers + peft generate with each adapter alone."""
    peft = pytest.importorskip("peft")
    from tests.integration.test_lora import ADAPTERS, MAX_RANK, _greedy_alone

    folder, model = tiny_folder(tmp_path, "llama", **changes)
    prompts = make_prompts(TINY["vocab_size"])[:3]
    jobs: list[tuple[str, int, str] | None] = [None]
    expected = {None: _greedy_alone(model, prompts)}
    for lora_id, name in enumerate(("every-projection", "q-v-rslora"), 1):
        torch.manual_seed(100 + lora_id)
        base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        config = peft.LoraConfig(init_lora_weights=False, **ADAPTERS[name])
        adapted = peft.get_peft_model(base, config).eval()
        adapted.save_pretrained(str(tmp_path / name))
        expected[name] = _greedy_alone(adapted, prompts)
        assert expected[name] != expected[None], name
        jobs.append((name, lora_id, str(tmp_path / name)))
    batch = [(job, ids) for ids in prompts for job in jobs]
    results = generate(
        tmp_path / "two", 2, str(folder), [ids for _, ids in batch], NUM_TOKENS,
        loras=[job for job, _ in batch], enable_lora=True, max_lora_rank=MAX_RANK,
    )  # fmt: skip
    for (job, ids), (tokens, _) in zip(batch, results, strict=True):
        name = None if job is None else job[0]
        assert tokens == expected[name][prompts.index(ids)][:NUM_TOKENS], name


def test_an_adapter_whose_files_vanish_fails_its_call_and_the_ranks_go_on(
    tmp_path: Path,
) -> None:
    """Two ranks, one device slot, one adapter in host memory: an adapter whose folder was
    removed after it left both cannot be read when a plan needs it (before, the ranks parted
    there, and the process exited). The call fails with the
    reason, every rank starts over together, and the next call runs as before."""
    peft = pytest.importorskip("peft")
    from tests.integration.test_lora import ADAPTERS, MAX_RANK

    folder, _ = tiny_folder(tmp_path, "llama")
    loras = []
    for lora_id, name in enumerate(ADAPTERS, 1):
        torch.manual_seed(100 + lora_id)
        base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        config = peft.LoraConfig(init_lora_weights=False, **ADAPTERS[name])
        peft.get_peft_model(base, config).save_pretrained(str(tmp_path / name))
        loras.append([name, lora_id, str(tmp_path / name)])
    settings = dict(enable_lora=True, max_lora_rank=MAX_RANK, max_loras=1, max_cpu_loras=1)
    job = {
        "model": str(folder),
        "config": {"tensor_parallel_size": 2, **settings},
        "prompt": make_prompts(TINY["vocab_size"])[0],
        "max_tokens": 8,
        "loras": loras,
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    argv = [sys.executable, "-m", "tests.integration.tp_lost_adapter"]
    argv += ["--job", str(tmp_path / "job.json"), "--out", str(tmp_path / "out.json")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert "every-projection" in result["error"] and "no adapter_config.json" in result["error"]
    assert result["after"] == result["before"]


def test_a_split_the_model_does_not_allow_is_refused() -> None:
    cfg = load_model_config(resolve_model_source(None))  # SmolLM2: 9 query, 3 KV heads
    with pytest.raises(ValueError, match="9 query heads do not split 2 ways") as refusal:
        ShardLayout.of(cfg, TensorParallel(rank=0, size=2))
    assert "3 KV heads neither split 2 ways nor divide 2" in str(refusal.value)
    layout = ShardLayout.of(cfg, TensorParallel(rank=2, size=3))
    local = layout.local_config
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 512)
    assert (layout.kv_head, layout.vocab_start) == (2, 2 * cfg.vocab_size // 3)


INT4_FORMATS = ["awq-g32", "gptq-g32-act-order", "ct-g32-asym"]


@pytest.fixture(scope="module")
def int4_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Cases:
    pytest.importorskip("compressed_tensors")
    from tests.integration.test_int4_parity import WRITERS
    from tests.integration.tiny_models import make_tiny_model

    base = tmp_path_factory.mktemp("int4")
    models = {}
    for fmt in INT4_FORMATS:
        model = make_tiny_model("llama")
        WRITERS[fmt](model, base / fmt / "model")  # the model now holds the dequantized weights
        models[fmt] = (base / fmt / "model", model, 2)
    return run_cases(base, models)


@pytest.mark.parametrize("fmt", INT4_FORMATS)
def test_int4_checkpoints_split_across_ranks(int4_checkpoints: Cases, fmt: str) -> None:
    """Each rank cuts its part of the packed weights, scales and zero points (act-order keeps
    every group's scales), and two ranks still give transformers' tokens on the weights the
    checkpoint stands for."""
    expected, folder = int4_checkpoints[fmt]
    assert tokens_of(folder) == expected, fmt


def test_fp8_on_two_ranks_stays_close_to_one(tmp_path: Path) -> None:
    """--quantization fp8 made at load: each rank quantizes its own rows' weights (scales per
    output channel: the same as one rank's) and its activations per token over its own input
    columns (row-parallel layers: other scales than one rank's). On a tiny random model, whose
    top logits lie close, that is enough to part the tokens early; where they first part, each
    run's token must be among the other's top logprobs (vLLM's rule)."""
    folder, _ = tiny_folder(tmp_path, "llama")
    prompts = make_prompts(TINY["vocab_size"])[:6]
    jobs = {
        tmp_path / name: make_job(world, str(folder), prompts, NUM_TOKENS, 5, quantization="fp8")
        for name, world in (("one", 1), ("two", 2))
    }
    run_jobs(jobs)  # in one process
    one, two = (job_results(out) for out in jobs)
    for (want, want_tops), (got, got_tops) in zip(one, two, strict=True):
        diverged = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if diverged is not None:
            assert got[diverged] in want_tops[diverged], (diverged, got, want)
            assert want[diverged] in got_tops[diverged], (diverged, got, want)
