"""Block-scaled FP8 (`kernels/fp8.py`): the reference's group quantization and product against
a plain per-group sum, and the Triton kernels against the reference (under the interpreter on
CPU, compiled at Llama shapes on a GPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import (
    FP8_MAX,
    aligned_block_scales,
    dequantize_fp8_groupwise,
    fp8_group_linear_reference,
    quantize_fp8_groupwise_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def test_group_quantization_keeps_each_group_within_e4m3_precision() -> None:
    x = torch.randn(3, 256) * torch.logspace(-3, 2, 256)  # groups of very different scales
    q, scale = quantize_fp8_groupwise_reference(x, 64)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 4)
    groups = x.reshape(3, 4, 64)
    assert torch.allclose(scale, groups.abs().amax(-1) / FP8_MAX)
    back = dequantize_fp8_groupwise(q, scale).reshape(3, 4, 64)
    assert torch.all((back - groups).abs() <= groups.abs() / 16 + scale[..., None] * 2**-9)


def test_the_reference_sums_each_groups_scaled_products() -> None:
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 128, generator=generator), torch.randn(6, 128, generator=generator)
    qx, xs = quantize_fp8_groupwise_reference(x, 32)
    qw, ws = quantize_fp8_groupwise_reference(w, 32)
    expected = torch.zeros(4, 6)
    for g in range(4):
        cols = slice(32 * g, 32 * g + 32)
        products = qx[:, cols].float() @ qw[:, cols].float().t()
        expected += products * xs[:, g, None] * ws[None, :, g]
    torch.testing.assert_close(fp8_group_linear_reference(x, qw, ws, 32), expected)


def test_columns_that_are_not_whole_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="not a multiple of the FP8 group of 128"):
        quantize_fp8_groupwise_reference(torch.zeros(2, 200), 128)


triton_fp8 = pytest.importorskip("kernels.triton_fp8", exc_type=ImportError)


def check(m: int, n: int, k: int, group: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, k, generator=generator) * k**-0.5
    qweight, weight_scale = (t.to(DEVICE) for t in quantize_fp8_groupwise_reference(w, group))
    x = torch.randn(m, k, generator=generator).to(DEVICE, DTYPE)
    b = torch.randn(n, generator=generator).to(DEVICE, DTYPE) if bias else None
    out = triton_fp8.fp8_group_linear(x, qweight, weight_scale, group, b)
    expected = fp8_group_linear_reference(x, qweight, weight_scale, group, b)
    assert out.dtype == DTYPE and out.shape == (m, n)
    # The same FP8 operands on both sides; the sums' order and the output rounding differ.
    tolerance = 2e-2 if torch.bfloat16 == DTYPE else 1e-5
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=tolerance * scale)


def test_triton_group_quantization_is_the_reference() -> None:
    x = (torch.randn(5, 256) * torch.logspace(-3, 2, 256)).to(DEVICE, DTYPE)
    q, scale = triton_fp8.quantize_fp8_groupwise(x, 32)
    q_ref, scale_ref = quantize_fp8_groupwise_reference(x, 32)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())


@pytest.mark.parametrize("m", [1, 5, 17, 70])  # the 16-row tiles, and the 64-row ones
@pytest.mark.parametrize("group", [32, 128])
def test_triton_matches_the_reference(m: int, group: int) -> None:
    check(m, n=72, k=256, group=group, bias=m == 5)  # N = 72: a partial tile of columns


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_triton_at_llama_shapes(m: int) -> None:
    for n, k in ((6144, 4096), (4096, 14336)):  # qkv, down; DeepSeek's 128 x 128 blocks
        check(m, n, k, group=128, bias=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [17, 18, 64, 300])  # rows padded to a multiple of 4 for cuBLASLt
def test_cublas_blockwise_path_matches_the_reference(
    m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kernels import quantized_ops
    from kernels.fp8 import quantize_fp8_blockwise_reference

    if not quantized_ops.blockwise_scaled_mm_supported(torch.device("cuda"), 1024):
        pytest.skip("cuBLASLt's blockwise-scaled FP8 GEMM needs Hopper and CUDA 12.9")

    def no_triton(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the Triton kernel ran instead of cuBLASLt")

    monkeypatch.setattr(triton_fp8, "fp8_group_linear", no_triton)

    generator = torch.Generator().manual_seed(m)
    n, k = 640, 1024
    w = torch.randn(n, k, generator=generator) * k**-0.5
    qweight, weight_scale = (t.cuda() for t in quantize_fp8_blockwise_reference(w, (128, 128)))
    block_scale = aligned_block_scales(weight_scale, 128)
    assert block_scale is not None
    x = torch.randn(m, k, generator=generator).cuda().to(torch.bfloat16)
    bias = torch.randn(n, generator=generator).cuda().to(torch.bfloat16)
    out = quantized_ops.fp8_group_linear(x, qweight, weight_scale, 128, bias, block_scale)
    expected = fp8_group_linear_reference(x, qweight, weight_scale, 128, bias)
    assert out.shape == (m, n)
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=2e-2 * scale)


def test_block_quantization_shares_a_scale_per_block() -> None:
    from kernels.fp8 import quantize_fp8_blockwise_reference

    w = torch.randn(40, 64) * torch.linspace(0.1, 10, 40)[:, None]
    q, scale = quantize_fp8_blockwise_reference(w, (16, 32))
    assert scale.shape == (40, 2)
    assert torch.equal(scale[:16], scale[:1].expand(16, 2))  # one block's rows share it
    assert torch.allclose(scale[32:].amax(), w[32:].abs().amax() / FP8_MAX)
    assert torch.allclose(
        dequantize_fp8_groupwise(q, scale), w, rtol=1 / 16, atol=scale.max() * 2**-9
    )


def test_block_scales_come_back_only_where_the_blocks_line_up() -> None:
    scale = torch.rand(5, 4)  # five blocks of 128 rows
    whole = torch.cat([scale[:2].repeat_interleave(128, 0), scale[2:].repeat_interleave(128, 0)])
    assert torch.equal(aligned_block_scales(whole, 128), scale)  # q (256 rows) + k + v
    # a fused projection whose first piece is 200 rows: its second starts inside a block
    shifted = torch.cat([scale[:2].repeat_interleave(100, 0), scale[2:].repeat_interleave(128, 0)])
    assert aligned_block_scales(shifted, 128) is None
