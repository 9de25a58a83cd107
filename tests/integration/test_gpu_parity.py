"""On a GPU in bfloat16, kvflow's greedy tokens agree with transformers' own forward pass.

Exact equality is not expected in bf16: two engines round differently, so where the top two
logits are within rounding of each other either may win. The check (in the style of vLLM's
logprob-closeness tests): teacher-force kvflow's output through transformers; at every
position transformers' argmax must be kvflow's token, unless transformers' top-2 gap is
within bf16 rounding, in which case the sequences may diverge there and the rest is skipped.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from test_parity import FAMILIES, TINY, kvflow_greedy, make_prompts

from kvflow import LLM

SHAPE = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
)


def rounding_tolerance(top_logit: float) -> float:
    # bf16 keeps 8 significant bits; a few layers of rounding stay within a few ulps.
    return 0.05 + 4 * 2**-8 * abs(top_logit)


def build(family: str, folder: object) -> torch.nn.Module:
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **extra, **SHAPE})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # random biases and norm weights, as in the CPU parity test
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.2)
    model.save_pretrained(folder)
    return model.cuda().eval()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_greedy_agrees_with_transformers(family: str, tmp_path: object) -> None:
    model = build(family, tmp_path)
    llm = LLM(
        str(tmp_path),
        device="cuda",
        dtype="bfloat16",
        max_model_len=512,
        kv_cache_memory_bytes=256 << 20,
    )
    prompts = make_prompts(SHAPE["vocab_size"])
    compared = total = 0
    for prompt, tokens in zip(prompts, kvflow_greedy(llm, prompts, ignore_eos=True), strict=True):
        ids = torch.tensor([prompt + tokens], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # predicts each token
        total += len(tokens)
        for position, token in enumerate(tokens):
            top2 = logits[position].topk(2).values
            compared += 1
            if int(logits[position].argmax()) == token:
                continue
            gap = float(top2[0] - top2[1])
            tolerance = rounding_tolerance(float(top2[0]))
            assert gap <= tolerance, (
                f"{family}: prompt of {len(prompt)}, token {position}: kvflow picked {token}, "
                f"transformers' argmax leads its runner-up by {gap:.3f} > {tolerance:.3f}"
            )
            break  # a legitimate tie-break: the sequences part here
    assert compared >= total // 2, f"only {compared} of {total} tokens compared"
