"""Mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral): greedy generation is token for token
transformers', under the engine settings that move KV around; the kernels' references agree
with a token-by-token recomputation; what is not built yet is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from kernels.moe import moe_experts_reference, moe_route_reference
from kvflow import LLM
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.parallel.tensor_parallel import TensorParallel
from shared.model_config import load_model_config, resolve_model_source
from tests.integration.test_parity import VARIANTS, hf_greedy, kvflow_greedy
from tests.integration.tiny_models import MOE_FAMILIES, TINY, make_prompts


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def tiny_moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family = request.param
    config_cls, extra = MOE_FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from 1 and random biases, or they would test nothing
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.2)
    folder = tmp_path_factory.mktemp(family.replace(" ", "_"))
    model.save_pretrained(folder)
    prompts = make_prompts(config.vocab_size)
    return family, Path(folder), prompts, hf_greedy(model, prompts, eos_token_id=None)


def test_a_mixture_of_experts_matches_transformers(tiny_moe) -> None:
    family, folder, prompts, expected = tiny_moe
    moe = load_model_config(resolve_model_source(str(folder))).moe
    assert moe is not None and moe.sparse_layers == ((1,) if "dense" in family else (0, 1))
    llm = LLM(str(folder), dtype="float32", device="cpu")
    assert kvflow_greedy(llm, prompts, ignore_eos=True) == expected, family
    assert kvflow_greedy(llm, prompts, ignore_eos=True) == expected, family  # prefix hits
    assert llm.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_mixture_of_experts_survives_engine_settings(tiny_moe, variant: str) -> None:
    family, folder, prompts, expected = tiny_moe
    llm = LLM(str(folder), dtype="float32", device="cpu", **VARIANTS[variant])
    assert kvflow_greedy(llm, prompts, ignore_eos=True) == expected, (family, variant)
    if variant == "small pool":
        assert llm.stats().num_preemptions > 0


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
    _, folder, _, _ = tiny_moe
    with pytest.raises(ValueError, match="LoRA on mixture-of-experts"):
        LLM(str(folder), dtype="float32", device="cpu", enable_lora=True)
    with pytest.raises(ValueError, match="quantized mixture-of-experts"):
        LLM(str(folder), dtype="bfloat16", device="cpu", quantization="fp8")
    config = load_model_config(resolve_model_source(str(folder)))
    with pytest.raises(ValueError, match="one rank for now"):
        DecoderForCausalLM(config, 64, tp=TensorParallel(rank=0, size=2))
