"""LoRA adapters served beside their base model: one continuous batch that mixes three PEFT
adapters and the base model gives, token for token, what transformers + peft generate with each
adapter alone (greedy, float32, CPU), for the Llama and Qwen3 families. The same holds when
fewer device slots than adapters force the scheduler to hold requests back and the executor to
refill slots while requests run, when the host cache is smaller than the adapters, and across
the prefix cache, which never gives one adapter's KV to another."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvflow import LLM, LoRARequest, SamplingParams
from shared.protocol import ParameterError
from tests.integration.tiny_models import NUM_NEW_TOKENS, TINY_ENGINE, make_prompts, make_tiny_model

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Three adapters unlike each other: every projection; attention only, rsLoRA; the MLP of one
# layer at the largest rank.
ADAPTERS = {
    "every-projection": dict(r=8, lora_alpha=16, target_modules=ALL),
    "q-v-rslora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp-layer-1": dict(
        r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"],
        layers_to_transform=[1],
    ),
}  # fmt: skip
MAX_RANK = 16


def _greedy_alone(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    outputs = []
    for ids in prompts:
        tokens = model.generate(
            torch.tensor([ids]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None
        )
        outputs.append(tokens[0, len(ids) :].tolist())
    return outputs


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The base model's folder, each adapter's LoRARequest, and every prompt's expected tokens
    under the base model (None) and under each adapter, each generated alone."""
    family = request.param
    root = tmp_path_factory.mktemp(f"lora-{family}")
    base = make_tiny_model(family)
    base.save_pretrained(root / "base")
    prompts = make_prompts(base.config.vocab_size)
    expected: dict[str | None, list[list[int]]] = {None: _greedy_alone(base, prompts)}
    loras = {}
    for index, (name, options) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + index)
        model = transformers.AutoModelForCausalLM.from_pretrained(root / "base").eval()
        config = peft.LoraConfig(init_lora_weights=False, **options)  # B random, not zero
        adapted = peft.get_peft_model(model, config).eval()
        adapted.save_pretrained(str(root / name))
        expected[name] = _greedy_alone(adapted, prompts)
        loras[name] = LoRARequest(name, index + 1, str(root / name))
    for name in ADAPTERS:  # else the test could not tell an adapter from the base model
        assert expected[name] != expected[None], name
    return family, root / "base", prompts, loras, expected


def _generate_mixed(llm: LLM, prompts, loras, order) -> dict[str | None, list[list[int]]]:
    """Every prompt under every adapter in `order` and the base model, in one batch."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    jobs = [(name, ids) for ids in prompts for name in order]
    results = llm.generate(
        [ids for _, ids in jobs],
        params,
        lora_request=[None if name is None else loras[name] for name, _ in jobs],
    )
    got: dict[str | None, list[list[int]]] = {name: [] for name in order}
    for (name, _), result in zip(jobs, results, strict=True):
        got[name].append(result.token_ids)
    return got


ORDER = [None, *ADAPTERS]
SETTINGS = {
    "a slot each": dict(max_loras=3),
    # two slots, three adapters: requests wait for a slot, slots are refilled as requests run
    "fewer slots": dict(max_loras=2, max_cpu_loras=2),
    "one slot, chunks, preemption": dict(
        max_loras=1, max_num_batched_tokens=32, num_gpu_blocks_override=24
    ),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_a_batch_mixing_adapters_matches_each_alone(served, setting: str) -> None:
    family, base, prompts, loras, expected = served
    options = dict(**TINY_ENGINE, enable_lora=True, max_lora_rank=MAX_RANK)
    llm = LLM(str(base), **options, **SETTINGS[setting])
    got = _generate_mixed(llm, prompts, loras, ORDER)
    for name in ORDER:
        assert got[name] == expected[name], (family, setting, name)
    if setting.startswith("one slot"):
        assert llm.stats().num_preemptions > 0


def test_adapters_keep_their_tokens_under_speculative_decoding(served) -> None:
    """Suffix decoding's drafts, verified under each row's adapter (one slot, chunked prompts,
    preemptions): the second pass finds the first's outputs among the recent outputs, so most
    drafts are accepted."""
    family, base, prompts, loras, expected = served
    setting = "one slot, chunks, preemption"
    options = dict(**TINY_ENGINE, enable_lora=True, max_lora_rank=MAX_RANK)
    spec = {"method": "suffix", "num_speculative_tokens": 4}
    llm = LLM(str(base), **options, **SETTINGS[setting], speculative_config=spec)
    for _ in range(2):
        got = _generate_mixed(llm, prompts, loras, ORDER)
        for name in ORDER:
            assert got[name] == expected[name], (family, setting, name)
    assert llm.stats().spec_num_accepted_tokens > 0


def test_the_prefix_cache_keeps_adapters_apart(served) -> None:
    family, base, prompts, loras, expected = served
    llm = LLM(str(base), **TINY_ENGINE, enable_lora=True, max_loras=3)
    name = "every-projection"
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)

    def hits_of(lora: LoRARequest | None) -> tuple[list[list[int]], int]:
        before = llm.stats().prefix_cache_hits
        results = llm.generate(prompts, params, lora_request=lora)
        return [r.token_ids for r in results], llm.stats().prefix_cache_hits - before

    first, own_hits = hits_of(loras[name])  # the prompts share a prefix among themselves
    # The same prompts under the base model and another adapter reuse nothing of the first...
    for other in (None, "q-v-rslora"):
        tokens, hits = hits_of(None if other is None else loras[other])
        assert tokens == expected[other], (family, other)
        assert hits == own_hits, (family, other)
    # ... and under the first adapter again, they reuse it.
    again, hits = hits_of(loras[name])
    assert again == first == expected[name]
    assert hits > own_hits


def test_bad_lora_requests_are_refused_and_nothing_else_breaks(served, tmp_path: Path) -> None:
    _, base, prompts, loras, expected = served
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    without = LLM(str(base), **TINY_ENGINE)
    with pytest.raises(ParameterError, match="enable_lora"):
        without.generate(prompts[:1], params, lora_request=loras["q-v-rslora"])
    llm = LLM(str(base), **TINY_ENGINE, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ParameterError, match="rank 16"):
        llm.generate(prompts[:1], params, lora_request=loras["mlp-layer-1"])
    with pytest.raises(ParameterError, match=r"adapter_config\.json"):
        llm.generate(prompts[:1], params, lora_request=LoRARequest("missing", 9, str(tmp_path)))
    taken = loras["q-v-rslora"]
    llm.generate(prompts[:1], params, lora_request=taken)
    with pytest.raises(ParameterError, match="already"):
        other = LoRARequest("other", taken.lora_int_id, str(base.parent / "every-projection"))
        llm.generate(prompts[:1], params, lora_request=other)
    with pytest.raises(ParameterError, match="one per prompt"):
        llm.generate(prompts[:2], params, lora_request=[taken])
    # The engine serves on, adapters and base model alike.
    results = llm.generate(prompts, params, lora_request=[taken, None] * (len(prompts) // 2))
    want = [expected["q-v-rslora" if i % 2 == 0 else None][i] for i in range(len(prompts))]
    assert [r.token_ids for r in results] == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adapters_on_the_gpu_agree_with_peft(tmp_path: Path) -> None:
    """bf16 on the GPU, decode in CUDA graphs, two slots for three adapters: each request's
    greedy tokens agree with transformers + peft by the closeness rule of test_gpu_parity."""
    from tests.integration.test_gpu_parity import (
        SHAPE,
        TOP,
        agreed_tokens,
        build,
        hf_greedy_top,
    )

    build("llama", tmp_path / "base")
    prompts = make_prompts(SHAPE["vocab_size"])[:4]
    loras, theirs = {}, {}
    for index, (name, options) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + index)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "base", dtype=torch.bfloat16
        )
        config = peft.LoraConfig(init_lora_weights=False, **options)
        adapted = peft.get_peft_model(model, config).cuda().eval()
        adapted.save_pretrained(str(tmp_path / name))
        theirs[name] = [hf_greedy_top(adapted, prompt) for prompt in prompts]
        loras[name] = LoRARequest(name, index + 1, str(tmp_path / name))
    llm = LLM(
        str(tmp_path / "base"), device="cuda", dtype="bfloat16", max_model_len=512,
        kv_cache_memory_bytes=256 << 20, enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK,
    )  # fmt: skip
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=TOP
    )
    jobs = [(name, i) for i in range(len(prompts)) for name in ADAPTERS]
    results = llm.generate(
        [prompts[i] for _, i in jobs], params, lora_request=[loras[name] for name, _ in jobs]
    )
    agreed = sum(
        agreed_tokens(f"{name}, prompt {i}", result, *theirs[name][i])
        for (name, i), result in zip(jobs, results, strict=True)
    )
    assert agreed >= len(jobs) * NUM_NEW_TOKENS // 10, f"only {agreed} tokens agreed"


@pytest.mark.slow
def test_a_mixture_of_experts_takes_adapters_on_attention_and_dense_layers(
    tmp_path: Path,
) -> None:
    """Qwen3-MoE with a dense first layer: an adapter of every attention projection (PEFT's)
    and of the dense layer's MLP (added to its file, and to the reference model as hooks: PEFT
    turns MLP targets of a mixture of experts into its experts' parameters), and kvflow gives
    its tokens; an adapter that reaches into the experts is refused by name, and the engine
    serves on."""
    from tests.integration.test_moe_fp8 import tiny_moe

    base = tiny_moe("qwen3_moe dense first")
    base.save_pretrained(tmp_path / "base")
    prompts = make_prompts(base.config.vocab_size)[:4]
    plain = _greedy_alone(base, prompts)
    torch.manual_seed(7)
    attention = ALL[:4]
    config = peft.LoraConfig(init_lora_weights=False, r=8, lora_alpha=16, target_modules=attention)
    adapted = peft.get_peft_model(base, config).eval()
    adapted.save_pretrained(str(tmp_path / "adapter"))
    folder = tmp_path / "adapter"
    tensors = load_file(folder / "adapter_model.safetensors")
    for proj in ALL[4:]:  # the dense layer's MLP, scaled as PEFT scales (alpha / r = 2)
        linear = getattr(base.model.layers[0].mlp, proj)
        a = torch.randn(8, linear.in_features) / 8
        b = torch.randn(linear.out_features, 8) / 8
        prefix = f"base_model.model.model.layers.0.mlp.{proj}"
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
        linear.register_forward_hook(lambda _m, x, out, a=a, b=b: out + 2.0 * x[0] @ a.T @ b.T)
    save_file(tensors, folder / "adapter_model.safetensors")
    listed = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**listed, "target_modules": ALL}))
    expected = _greedy_alone(adapted, prompts)
    assert expected != plain  # it adapts something
    llm = LLM(str(tmp_path / "base"), **TINY_ENGINE, enable_lora=True,
              max_lora_rank=8)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    lora = LoRARequest("attention-and-dense", 1, str(folder))
    assert [r.token_ids for r in llm.generate(prompts, params, lora_request=lora)] == expected
    # An expert's projection in the adapter's file: refused, naming what it adapts.
    expert = "base_model.model.model.layers.1.mlp.experts.0.gate_proj"
    tensors[f"{expert}.lora_A.weight"] = torch.zeros(8, base.config.hidden_size)
    tensors[f"{expert}.lora_B.weight"] = torch.zeros(base.config.moe_intermediate_size, 8)
    shutil.copytree(folder, tmp_path / "experts")
    save_file(tensors, tmp_path / "experts" / "adapter_model.safetensors")
    refused = LoRARequest("experts", 2, str(tmp_path / "experts"))
    with pytest.raises(ParameterError, match="mixture of experts' layer"):
        llm.generate(prompts[:1], params, lora_request=refused)
    assert [r.token_ids for r in llm.generate(prompts, params, lora_request=lora)] == expected
