"""The Triton FP8 kernels against `kernels.fp8`'s references (under the interpreter on CPU,
compiled on a GPU): the per-token quantization, the skinny linear with FP8 operands for every
row count a decode step has, and the RMSNorm and SiLU-and-mul kernels that quantize their
output for an FP8 layer in the same pass (the same e4m3 values as the unfused pair)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import triton_activation, triton_split_k
from kernels.activation import silu_and_mul_fp8_reference
from kernels.fp8 import FP8, Fp8Rows, fp8_linear_reference, quantize_fp8_rowwise_reference
from kernels.norm import fused_add_rms_norm_fp8_reference, rms_norm_fp8_reference
from kernels.triton_activation import silu_and_mul, silu_and_mul_fp8
from kernels.triton_fp8 import (
    Fp8Tiles,
    fp8_default_tiles,
    fp8_skinny_linear,
    quantize_fp8_rowwise,
)
from kernels.triton_norm import fused_add_rms_norm, fused_add_rms_norm_fp8, rms_norm, rms_norm_fp8

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


def test_static_quantization_matches_the_reference_and_saturates() -> None:
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 300, generator=generator) * 3).to(DEVICE)
    x[0, 0] = 1e4  # past 448 * scale: saturates at 448
    static = torch.tensor([0.02], device=DEVICE)
    q, scale = quantize_fp8_rowwise(x, static)
    want_q, want_scale = quantize_fp8_rowwise_reference(x, static)
    assert torch.equal(scale, want_scale) and scale.shape == (5, 1)
    assert torch.equal(q.float(), want_q.float()) and q[0, 0].float() == 448


def test_a_zero_row_quantizes_to_zeros() -> None:
    q, scale = quantize_fp8_rowwise(torch.zeros(2, 32, device=DEVICE))
    assert torch.equal(q.float(), torch.zeros(2, 32, device=DEVICE)) and (scale > 0).all()


@pytest.mark.parametrize("m", [1, 2, 7, 16, 40])  # tl.dot tiles of 16 rows, and of 64
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


def test_skinny_fp8_linear_takes_rows_its_producer_quantized() -> None:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(3, 96, generator=generator).to(DEVICE, DTYPE)
    qweight, scale = quantize_fp8_rowwise_reference(torch.randn(32, 96, generator=generator))
    qweight, scale = qweight.to(DEVICE), scale[:, 0].to(DEVICE)
    out = fp8_skinny_linear(Fp8Rows.quantize(x), qweight, scale)
    assert out.dtype == DTYPE
    assert torch.equal(out, fp8_skinny_linear(x, qweight, scale))


# (M, N, K, tiles): one row in a tile of 8, rows past a tile, a masked K tail, N not a multiple of
# the weight tile, and K split in 2, 3 and 4 (5 steps in 4 splits: 2, 2, 1 and none).
GEMV_CASES = [
    (1, 80, 160, Fp8Tiles(8, 64, 64, 4, 2)),
    (3, 64, 512, Fp8Tiles(8, 64, 64, 4, 2, split_k=2)),
    (3, 64, 320, Fp8Tiles(8, 64, 64, 4, 2, split_k=4)),
    (9, 130, 1000, Fp8Tiles(16, 64, 128, 4, 3, split_k=3)),
    (12, 64, 256, Fp8Tiles(8, 64, 32, 4, 2, split_k=3)),
    (40, 128, 256, Fp8Tiles(64, 128, 32, 8, 2)),
]


@pytest.mark.parametrize(("m", "n", "k", "tiles"), GEMV_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv_matches_the_reference(
    m: int, n: int, k: int, tiles: Fp8Tiles, bias: bool
) -> None:
    generator = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=generator).to(DEVICE, DTYPE)
    weight = torch.randn(n, k, generator=generator).to(DEVICE) * 0.1
    qweight, scale = quantize_fp8_rowwise_reference(weight)
    b = torch.randn(n, generator=generator).to(DEVICE, DTYPE) if bias else None
    expected = fp8_linear_reference(x, qweight, scale[:, 0], b)
    outs = []
    for _ in range(2):  # the second call finds the ticket counters as the first left them
        outs.append(fp8_skinny_linear(x, qweight, scale[:, 0], b, tiles=tiles))
        assert outs[-1].dtype == DTYPE and outs[-1].shape == (m, n)
        tolerance = 2e-2 if DEVICE == "cuda" else 1e-4  # bf16 outputs there, float32 here
        torch.testing.assert_close(
            outs[-1].float(), expected.float(), rtol=tolerance, atol=tolerance
        )
        if tiles.split_k > 1:
            assert not triton_split_k.tickets(x.device).any()
    assert torch.equal(outs[0], outs[1])  # the splits added in split order, every time


def test_fp8_default_tiles_split_narrow_layers_and_pad_rows_to_eight() -> None:
    down, gate_up = fp8_default_tiles(1, 4096, 14336), fp8_default_tiles(1, 28672, 4096)
    assert (down.block_m, gate_up.block_m, fp8_default_tiles(9, 4096, 4096).block_m) == (8, 8, 16)
    assert (down.split_k, fp8_default_tiles(9, 4096, 14336).split_k, gate_up.split_k) == (4, 2, 1)
    assert fp8_default_tiles(1, 64, 160).split_k == 1  # one K step: nothing to share
    wide_64 = fp8_default_tiles(64, 28672, 4096)  # the sweep's best there: 256 K in 3 stages
    assert (wide_64.block_m, wide_64.block_k, wide_64.num_stages) == (64, 256, 3)
    with pytest.raises(ValueError, match="power of two"):
        Fp8Tiles(8, 48, 64, 4, 2)


# --- Producers that quantize for the FP8 layer they feed ---------------------------------------

DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def assert_same_rows(got: Fp8Rows, want_q: torch.Tensor, want_scale: torch.Tensor) -> None:
    assert got.q.dtype == FP8 and got.scale.shape == (got.q.shape[0], 1) and got.dtype == DTYPE
    assert torch.equal(got.scale, want_scale)
    assert torch.equal(got.q.float(), want_q.float())


def assert_close_rows(got: Fp8Rows, want: Fp8Rows) -> None:
    """Against the torch reference, which rounds a little differently (the norm sums in another
    order; in bf16 it rounds silu(gate) before the product, about an ulp, and so may the row's
    maximum and scale): the scales agree closely, and a value on a rounding boundary may land
    one e4m3 step away, as a few percent of values do."""
    torch.testing.assert_close(got.scale, want.scale, rtol=1e-2, atol=0)
    a, b = (r.q.float().cpu() for r in (got, want))
    step = torch.maximum(a.abs(), b.abs()) / 8 + 2**-9  # 3 mantissa bits; subnormals' step
    assert ((a - b).abs() <= step).all()
    assert (a != b).float().mean() < 0.1


@pytest.mark.parametrize("shape", [(1, 64), (5, 96), (3, 1000), (2, 4096)])  # and Llama's
def test_rms_norm_fp8_quantizes_the_normed_rows(shape: tuple[int, int]) -> None:
    generator = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(shape, generator=generator) * 4).to(DEVICE, DTYPE)
    weight = (1 + torch.randn(shape[1], generator=generator) / 4).to(DEVICE, DTYPE)
    x[0] = 0.0  # a zero row keeps a usable scale
    got = rms_norm_fp8(x, weight, 1e-6)
    assert_same_rows(got, *quantize_fp8_rowwise(rms_norm(x, weight, 1e-6)))
    assert_close_rows(got, rms_norm_fp8_reference(x, weight, 1e-6))


def test_fused_add_rms_norm_fp8_updates_the_residual_and_leaves_x() -> None:
    generator = torch.Generator().manual_seed(7)
    x, residual = (torch.randn(4, 200, generator=generator).to(DEVICE, DTYPE) for _ in range(2))
    weight = (1 + torch.randn(200, generator=generator) / 4).to(DEVICE, DTYPE)
    x_before, residual_before = x.clone(), residual.clone()
    got, new_residual = fused_add_rms_norm_fp8(x, residual, weight, 1e-6)
    assert new_residual is residual and torch.equal(x, x_before)
    normed, summed = fused_add_rms_norm(x.clone(), residual_before.clone(), weight, 1e-6)
    assert torch.equal(residual, summed)
    assert_same_rows(got, *quantize_fp8_rowwise(normed))
    want, want_residual = fused_add_rms_norm_fp8_reference(x, residual_before, weight, 1e-6)
    assert torch.equal(residual, want_residual)
    assert_close_rows(got, want)


@pytest.mark.parametrize(("inter", "two_passes"), [(200, False), (200, True), (14336, False)])
def test_silu_and_mul_fp8_quantizes_the_product(
    inter: int, two_passes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if two_passes:  # rows longer than a program holds: computed twice, by blocks
        monkeypatch.setattr(triton_activation, "FP8_BLOCK", 64)
    generator = torch.Generator().manual_seed(11)
    gate_up = (torch.randn(3, 2 * inter, generator=generator) * 3).to(DEVICE, DTYPE)
    gate_up[1] = 0.0
    got = silu_and_mul_fp8(gate_up)
    assert_same_rows(got, *quantize_fp8_rowwise(silu_and_mul(gate_up)))
    assert_close_rows(got, silu_and_mul_fp8_reference(gate_up))


def test_producers_quantize_by_a_static_scale_as_the_layer_would() -> None:
    generator = torch.Generator().manual_seed(13)
    x, residual = (torch.randn(3, 96, generator=generator).to(DEVICE, DTYPE) for _ in range(2))
    weight = (1 + torch.randn(96, generator=generator) / 4).to(DEVICE, DTYPE)
    gate_up = (torch.randn(3, 2 * 1500, generator=generator) * 3).to(DEVICE, DTYPE)  # 2 tiles
    static = torch.tensor([0.01], device=DEVICE)  # small: some values saturate
    assert_same_rows(
        rms_norm_fp8(x, weight, 1e-6, static),
        *quantize_fp8_rowwise(rms_norm(x, weight, 1e-6), static),
    )
    normed, _ = fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    got, _ = fused_add_rms_norm_fp8(x, residual, weight, 1e-6, static)
    assert_same_rows(got, *quantize_fp8_rowwise(normed, static))
    assert_same_rows(
        silu_and_mul_fp8(gate_up, static), *quantize_fp8_rowwise(silu_and_mul(gate_up), static)
    )
    assert_close_rows(
        silu_and_mul_fp8(gate_up, static), silu_and_mul_fp8_reference(gate_up, static)
    )


def test_fp8_producers_refuse_what_they_cannot_quantize() -> None:
    x = torch.randn(2, 64, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="same dtype"):
        rms_norm_fp8(x, torch.ones(64, device=DEVICE, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="2-D"):
        rms_norm_fp8(x.view(2, 2, 32), torch.ones(32, device=DEVICE, dtype=DTYPE), 1e-6)
    with pytest.raises(ValueError, match="2-D"):
        silu_and_mul_fp8(x.view(2, 2, 32))
