"""MXFP4 experts (gpt-oss's) in the int4 experts' grouped GEMMs (kernels/triton_moe_int4.py,
`Int4Stack.e2m1`), with gpt-oss's biases and clamped SwiGLU, against the torch reference on
the weights the codes stand for. On the CPU under the Triton interpreter (small shapes); on
the GPU at gpt-oss-20b's shape."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.int4 import Int4Stack
from kernels.moe import (
    ClampedSwiglu,
    ExpertBiases,
    moe_experts_int4_reference,
    moe_experts_reference,
    moe_route_reference,
)
from kernels.mxfp4 import E2M1_VALUES, as_int4_layout, dequantize_4bit_stack, dequantize_mxfp4
from kernels.triton_moe_int4 import moe_experts_int4
from tests.quantized_writers import mxfp4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SWIGLU = ClampedSwiglu(limit=7.0)  # gpt-oss's


def mxfp4_stack(experts: int, rows: int, cols: int, generator: torch.Generator) -> Int4Stack:
    """Random float experts rounded to MXFP4 as gpt-oss's checkpoints are, in the kernels'
    layout; every code occurs (the groups' spread reaches each e2m1 value)."""
    weight = torch.randn(experts, rows, cols, generator=generator) * 0.05
    blocks, scales, _ = mxfp4(weight)
    qweight, values = as_int4_layout(blocks, scales)
    return Int4Stack(qweight.to(DEVICE), values.to(DEVICE), None, 32, e2m1=True)


def routed(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=generator)
    return moe_route_reference(logits.to(DEVICE), top_k, renormalize=True)


def biases_of(experts: int, hidden: int, inter: int, generator: torch.Generator) -> ExpertBiases:
    gate_up = torch.randn(experts, 2 * inter, generator=generator) * 0.5
    return ExpertBiases(gate_up.to(DEVICE), (torch.randn(experts, hidden) * 0.1).to(DEVICE))


def test_the_layout_keeps_every_code_and_scale() -> None:
    """as_int4_layout moves the checkpoint's nibbles, not their meaning: the stack
    dequantizes to exactly what the blocks and scales stand for, all 16 codes included."""
    generator = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, 8, 3, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 140, (2, 8, 3), dtype=torch.uint8, generator=generator)
    qweight, values = as_int4_layout(blocks, scales)
    stack = Int4Stack(qweight, values, None, 32, e2m1=True)
    expected = dequantize_mxfp4(blocks, scales)
    assert torch.equal(dequantize_4bit_stack(stack, torch.float32), expected)
    assert set(expected.div(values.float().repeat_interleave(32, -1)).unique().tolist()) == set(
        E2M1_VALUES
    )


@pytest.mark.parametrize(
    ("tokens", "with_biases"),
    [
        (1, True),  # one token: the grouped GEMMs still (MXFP4 takes no GEMV)
        (9, True),  # several blocks' pairs, gpt-oss's epilogues
        (6, False),  # MXFP4 alone, silu(gate) * up
    ],
)
def test_mxfp4_experts_match_the_reference(tokens: int, with_biases: bool) -> None:
    hidden, inter, experts, top_k = 128, 64, 4, 2
    generator = torch.Generator().manual_seed(tokens)
    gate_up = mxfp4_stack(experts, 2 * inter, hidden, generator)
    down = mxfp4_stack(experts, hidden, inter, generator)
    biases = biases_of(experts, hidden, inter, generator) if with_biases else None
    swiglu = SWIGLU if with_biases else None
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    weights, ids = routed(tokens, experts, top_k, seed=tokens)
    out = moe_experts_int4(x, gate_up, down, weights, ids, biases, swiglu)
    expected = moe_experts_int4_reference(x, gate_up, down, weights, ids, biases, swiglu)
    float_weights = (dequantize_4bit_stack(gate_up, x.dtype), dequantize_4bit_stack(down, x.dtype))
    on_floats = moe_experts_reference(x, *float_weights, weights, ids, biases=biases, swiglu=swiglu)
    assert torch.equal(expected, on_floats)
    scale = float(expected.abs().max())
    tolerance = 1e-2 * scale if out.is_cuda else 1e-4 * scale  # GPU: TF32 dots
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=tolerance)


def test_mxfp4_experts_refuse_zero_points_and_other_groups() -> None:
    generator = torch.Generator().manual_seed(0)
    gate_up = mxfp4_stack(2, 64, 64, generator)
    down = mxfp4_stack(2, 64, 32, generator)
    weights, ids = routed(3, 2, 1, seed=0)
    x = torch.randn(3, 64, device=DEVICE)
    zeros = torch.zeros_like(down.scales, dtype=torch.uint8)
    with pytest.raises(ValueError, match="MXFP4 experts have no zero points"):
        moe_experts_int4(x, gate_up, down._replace(zeros=zeros), weights, ids)


@pytest.mark.skipif(DEVICE == "cpu", reason="16-bit tensor-core dots: on the GPU")
@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_mxfp4_experts_in_bf16_at_gpt_oss_20bs_shape(tokens: int) -> None:
    """gpt-oss-20b's experts: 32 of 2880 columns over 2880, top 4, biases, clamped SwiGLU."""
    hidden, inter, experts, top_k = 2880, 2880, 32, 4
    generator = torch.Generator().manual_seed(tokens)
    gate_up = mxfp4_stack(experts, 2 * inter, hidden, generator)
    down = mxfp4_stack(experts, hidden, inter, generator)
    biases = biases_of(experts, hidden, inter, generator)
    biases = ExpertBiases(*(b.to(torch.bfloat16) for b in biases))
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE, torch.bfloat16)
    weights, ids = routed(tokens, experts, top_k, seed=tokens)
    out = moe_experts_int4(x, gate_up, down, weights, ids, biases, SWIGLU)
    expected = moe_experts_int4_reference(x, gate_up, down, weights, ids, biases, SWIGLU)
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2 * scale)
