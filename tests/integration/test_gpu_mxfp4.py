"""On a GPU, gpt-oss from an MXFP4 checkpoint as published, its experts kept MXFP4 (the default
on CUDA): the whole engine's greedy tokens against transformers' on the weights the checkpoint
stands for, by test_gpu_parity's closeness rule, eager and under CUDA graphs. What the CPU's
tests cannot show: the Triton kernels inside the engine (the CPU runs their references), at
a hidden size and expert width whose K steps are the GPU's (64 and more)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.integration.test_gpu_parity import MIN_AGREED, SHAPE, agreement, gpu_llm
from tests.integration.tiny_models import MOE_FAMILIES, NUM_NEW_TOKENS, TINY
from tests.quantized_writers import write_mxfp4_gpt_oss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("experts", ["mxfp4", "float"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_mxfp4_experts_agree_with_transformers(
    enforce_eager: bool, experts: str, tmp_path: Path
) -> None:
    """`float`: the same weights saved as floats, so that a failure of the MXFP4 experts is
    told apart from one of gpt-oss's other layers on the GPU (sinks, windows, YaRN). In
    float32, as test_gpu_parity's mixtures of experts (in bf16 the engines' routing parts at
    near ties); the bf16 kernels' decode: tests/kernels/test_triton_moe_mxfp4.py."""
    dtype = "float32"
    config_cls, extra = MOE_FAMILIES["gpt_oss"]
    torch.manual_seed(0)
    shape = {**SHAPE, "intermediate_size": 128}  # the experts' width: two GPU K steps
    config = config_cls(**{**TINY, **extra, **shape})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases and norm weights, as in the parity tests
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.2)
    write_mxfp4_gpt_oss(model, tmp_path / "mxfp4")  # the model now holds what the codes stand for
    model.save_pretrained(tmp_path / "float")
    model = model.to("cuda", getattr(torch, dtype)).eval()
    llm = gpu_llm(tmp_path / experts, dtype, enforce_eager=enforce_eager)
    mlp = llm.runner.model.layers[0].mlp
    if experts == "mxfp4":
        assert mlp.method.name == "mxfp4" and mlp.experts_gate_up.dtype == torch.int32
    agreed = [n for _, n in agreement(f"gpt-oss {experts}", model, llm)]
    assert sum(agreed) >= MIN_AGREED[dtype] * NUM_NEW_TOKENS * len(agreed), agreed
