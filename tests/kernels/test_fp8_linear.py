"""FP8 W8A8 linear layers: the reference against exact arithmetic, and `quantized_ops.fp8_linear` on
CUDA (the FP8 GEMV up to 64 rows, cuBLASLt's scaled GEMM past that) against the
reference at the Llama-3.1-8B shapes."""

from __future__ import annotations

import pytest
import torch

from kernels import quantized_ops
from kernels.fp8 import (
    FP8,
    FP8_MAX,
    Fp8Rows,
    fp8_linear_reference,
    quantize_fp8_rowwise_reference,
)


def test_rowwise_quantization_round_trips_within_e4m3_precision() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=generator) * torch.logspace(-3, 3, 64)[:, None]
    q, scale = quantize_fp8_rowwise_reference(x)
    assert q.dtype == FP8 and scale.shape == (64, 1)
    # Each row's largest magnitude lands on e4m3's largest value.
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((64,), FP8_MAX))
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2**-4 for normal values.
    back = q.float() * scale
    big = x.abs() > scale * 2**-6  # below e4m3's normal range the error is absolute
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-12)[big].all()


def test_a_row_of_zeros_quantizes_to_zeros() -> None:
    q, scale = quantize_fp8_rowwise_reference(torch.zeros(2, 16))
    assert torch.equal(q.float(), torch.zeros(2, 16)) and (scale > 0).all()


def test_the_reference_is_the_product_of_the_dequantized_operands() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=generator)
    weight = torch.randn(48, 64, generator=generator)
    bias = torch.randn(48, generator=generator)
    qweight, weight_scale = quantize_fp8_rowwise_reference(weight)
    qx, x_scale = quantize_fp8_rowwise_reference(x)
    expected = (qx.double() * x_scale.double()) @ (qweight.double() * weight_scale.double()).t()
    out = fp8_linear_reference(x, qweight, weight_scale[:, 0], bias)
    torch.testing.assert_close(out.double(), expected + bias.double(), rtol=1e-5, atol=1e-5)
    # ...and close to the float layer it stands for (e4m3: about 3 % per operand).
    exact = x @ weight.t() + bias
    assert ((out - exact).norm() / exact.norm()).item() < 0.05


# (N, K) of Llama-3.1-8B's qkv, o, gate_up and down projections
LLAMA_SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", sorted(LLAMA_SHAPES))
@pytest.mark.parametrize("m", [1, 16, 33, 64, 65, 300])  # the FP8 GEMV to 64, then cuBLASLt
def test_gpu_fp8_linear_matches_the_reference(shape: str, m: int) -> None:
    n, k = LLAMA_SHAPES[shape]
    generator = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=generator).to(torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", generator=generator) * 0.02
    qweight, scale = quantize_fp8_rowwise_reference(weight)
    bias = torch.randn(n, device="cuda", generator=generator).to(torch.bfloat16)
    out = quantized_ops.fp8_linear(x, qweight, scale[:, 0], bias)
    expected = fp8_linear_reference(x, qweight, scale[:, 0], bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # Both sum the same fp8 products in float32; the outputs differ by bf16 rounding.
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_quantized_rows_take_no_second_scale() -> None:
    x = torch.randn(2, 32)
    qweight, scale = quantize_fp8_rowwise_reference(torch.randn(8, 32))
    with pytest.raises(ValueError, match="quantized already"):
        quantized_ops.fp8_linear(
            Fp8Rows.quantize(x), qweight, scale[:, 0], input_scale=torch.ones(1)
        )
