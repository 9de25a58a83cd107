"""The Triton FP8 kernels against `kernels.fp8`'s references (under the interpreter on CPU,
compiled on a GPU): the per-token quantization, and the skinny linear with FP8 operands for
every row count a decode step has."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.fp8 import FP8, fp8_linear_reference, quantize_fp8_rowwise_reference
from kernels.triton_fp8 import fp8_skinny_linear, quantize_fp8_rowwise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", [(1, 64), (3, 100), (5, 4100), (64, 4096)])  # K past a step
def test_quantization_matches_the_reference(shape: tuple[int, int]) -> None:
    generator = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(shape, generator=generator) * 3).to(DEVICE)
    x[0, :7] = 0.0
    q, scale = quantize_fp8_rowwise(x)
    want_q, want_scale = quantize_fp8_rowwise_reference(x)
    assert q.dtype == FP8 and scale.shape == (shape[0], 1)
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    # The same e4m3 values: both round x / scale to nearest, ties to even.
    assert torch.equal(q.float(), want_q.float())


def test_a_zero_row_quantizes_to_zeros() -> None:
    q, scale = quantize_fp8_rowwise(torch.zeros(2, 32, device=DEVICE))
    assert torch.equal(q.float(), torch.zeros(2, 32, device=DEVICE)) and (scale > 0).all()


@pytest.mark.parametrize("m", [1, 2, 7, 16])  # the fma variant (1) and tl.dot tiles of 16
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_fp8_linear_matches_the_reference(m: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(m)
    n, k = 48, 160  # K not a multiple of the K step: the masked tail
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(m, k, generator=generator).to(DEVICE, dtype)
    weight = torch.randn(n, k, generator=generator).to(DEVICE) * 0.1
    qweight, scale = quantize_fp8_rowwise_reference(weight)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    out = fp8_skinny_linear(x, qweight, scale[:, 0], b)
    expected = fp8_linear_reference(x, qweight, scale[:, 0], b)
    assert out.dtype == dtype and out.shape == (m, n)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
