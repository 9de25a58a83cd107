"""The small Triton kernels (RMSNorm, SiLU-and-mul) against their torch references.

(Rotary and the KV write are one fused kernel: tests/kernels/test_triton_rotary_cache.py.)
Inputs are laid out as in the decoder: q/k are strided views into one fused qkv output.
In-place kernels must return their inputs and match the reference computed on clones. On CPU
the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so
CPU shapes are small.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.activation import (
    gelu_tanh_and_mul_fp8_reference,
    gelu_tanh_and_mul_reference,
    silu_and_mul_reference,
)
from kernels.norm import (
    fused_add_rms_norm_reference,
    fused_norm_add_rms_norm_reference,
    rms_norm_pair_reference,
    rms_norm_reference,
)
from kernels.triton_activation import gelu_tanh_and_mul, gelu_tanh_and_mul_fp8, silu_and_mul
from kernels.triton_norm import (
    fused_add_rms_norm,
    fused_norm_add_rms_norm,
    rms_norm,
    rms_norm_pair,
)
from tests.kernels.test_triton_fp8 import assert_close_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
TIGHT = {"rtol": 1e-5, "atol": 1e-5}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(device=DEVICE, dtype=dtype)


def split_qkv(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv and the decoder's q, k, v: views [T, H|KV, D] into it, rows (H + 2 KV) * D apart."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, gen=gen, dtype=dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        qkv,
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


def rel_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).norm() / expected.float().norm()).item()


# --- RMSNorm -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7, 96), (3, 1000), (1, 64), (2, 3, 40)])
def test_rms_norm_matches_reference(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x, weight = randn(*shape, gen=gen), randn(shape[-1], gen=gen)
    out = rms_norm(x, weight, EPS)
    assert out.is_contiguous() and out.shape == x.shape
    torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS), **TIGHT)


def test_rms_norm_on_qwen3_head_views_reads_in_place() -> None:
    """Per-head q/k norm on views into qkv: rows strided by (H + 2 KV) * D, heads by D."""
    gen = torch.Generator().manual_seed(1)
    qkv, q, k, _ = split_qkv(9, 6, 2, 32, gen=gen)
    before = qkv.clone()
    weight = randn(32, gen=gen)
    for x in (q, k):
        out = rms_norm(x, weight, EPS)
        assert out.is_contiguous() and out.data_ptr() != x.data_ptr()
        torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS), **TIGHT)
    assert torch.equal(qkv, before)  # the input is only read


def test_rms_norm_rows_with_padding_stride() -> None:
    gen = torch.Generator().manual_seed(2)
    x = randn(5, 128, gen=gen)[:, :72]  # [5, 72] with row stride 128
    weight = randn(72, gen=gen)
    torch.testing.assert_close(
        rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS), **TIGHT
    )


@pytest.mark.parametrize(("rows", "hidden"), [(3, 96), (1, 1000), (5, 40)])
def test_rms_norm_pair_is_both_norms_side_by_side(rows: int, hidden: int) -> None:
    """Each input normed by its own weight into its half of one row; b strided (a view into a
    wider buffer, as a draft's stream is); the inputs only read."""
    gen = torch.Generator().manual_seed(rows * hidden)
    a = randn(rows, hidden, gen=gen)
    b = randn(rows, hidden + 8, gen=gen)[:, :hidden]
    a_weight, b_weight = randn(hidden, gen=gen), randn(hidden, gen=gen)
    before = a.clone(), b.clone()
    out = rms_norm_pair(a, a_weight, b, b_weight, EPS)
    assert out.shape == (rows, 2 * hidden) and out.is_contiguous()
    torch.testing.assert_close(out, rms_norm_pair_reference(a, a_weight, b, b_weight, EPS), **TIGHT)
    torch.testing.assert_close(out[:, hidden:], rms_norm_reference(b, b_weight, EPS), **TIGHT)
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])


def test_rms_norm_pair_refuses_inputs_of_two_shapes() -> None:
    a, b, weight = torch.ones(2, 8), torch.ones(3, 8), torch.ones(8)
    with pytest.raises(ValueError, match="one shape and dtype"):
        rms_norm_pair(a, weight, b, weight, EPS)


@pytest.mark.parametrize("strided", [False, True])
def test_fused_add_rms_norm_in_place(strided: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    x, residual = randn(6, 160, gen=gen), randn(6, 160, gen=gen)
    if strided:
        x = x[:, :100]  # rows 160 apart, as a slice of a wider buffer
        residual = residual[:, 20:120]
    weight = randn(x.shape[-1], gen=gen)
    expected_normed, expected_residual = fused_add_rms_norm_reference(
        x.clone(), residual.clone(), weight, EPS
    )
    x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()

    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)

    assert normed is x and new_residual is residual
    assert normed.data_ptr() == x_ptr and new_residual.data_ptr() == residual_ptr
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, expected_normed, **TIGHT)


def test_fused_add_rms_norm_odd_layout_keeps_in_place_contract() -> None:
    """Hidden dim not contiguous: computed on copies, copied back into the inputs."""
    gen = torch.Generator().manual_seed(4)
    x, residual = randn(48, 5, gen=gen).t(), randn(48, 5, gen=gen).t()  # [5, 48], stride (1, 5)
    weight = randn(48, gen=gen)
    expected = fused_add_rms_norm_reference(x.clone(), residual.clone(), weight, EPS)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert normed is x and new_residual is residual
    torch.testing.assert_close(new_residual, expected[1], rtol=0, atol=0)
    torch.testing.assert_close(normed, expected[0], **TIGHT)


def test_fused_norm_add_rms_norm_in_place() -> None:
    """Gemma's norm after a sublayer and the next one's before it, in one launch (float32:
    the interpreter rounds bf16 otherwise than torch; the GPU test below takes bf16)."""
    gen = torch.Generator().manual_seed(5)
    x, residual = randn(5, 96, gen=gen), randn(5, 96, gen=gen)
    x_weight, weight = randn(96, gen=gen), randn(96, gen=gen)
    expected = fused_norm_add_rms_norm_reference(x.clone(), residual.clone(), x_weight, weight, EPS)
    unnormed = fused_add_rms_norm_reference(x.clone(), residual.clone(), weight, EPS)
    assert not torch.allclose(expected[1], unnormed[1])  # x's own norm changes the sum
    normed, new_residual = fused_norm_add_rms_norm(x, residual, x_weight, weight, EPS)
    assert normed is x and new_residual is residual
    torch.testing.assert_close(new_residual, expected[1], **TIGHT)
    torch.testing.assert_close(normed, expected[0], **TIGHT)


# --- SiLU-and-mul ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 80), (2, 3000), (2, 2, 24)])  # 1500 > one 1024 block
def test_silu_and_mul_matches_reference(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    gate_up = randn(*shape, gen=gen) * 4
    out = silu_and_mul(gate_up)
    assert out.is_contiguous() and out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out, silu_and_mul_reference(gate_up), **TIGHT)


@pytest.mark.parametrize("shape", [(3, 80), (2, 3000)])
def test_gelu_tanh_and_mul_matches_reference(shape: tuple[int, ...]) -> None:
    """GeGLU (Gemma): gate values far out on both sides, where tanh saturates."""
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    gate_up = randn(*shape, gen=gen) * 8
    out = gelu_tanh_and_mul(gate_up)
    torch.testing.assert_close(out, gelu_tanh_and_mul_reference(gate_up), **TIGHT)
    # the FP8 variant: as test_triton_fp8's silu_and_mul_fp8 (a value may land one step away)
    assert_close_rows(gelu_tanh_and_mul_fp8(gate_up), gelu_tanh_and_mul_fp8_reference(gate_up))


def test_silu_and_mul_strided_rows() -> None:
    gen = torch.Generator().manual_seed(6)
    gate_up = randn(4, 100, gen=gen)[:, :64]  # row stride 100
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), **TIGHT)


# --- GPU: real shapes in half precision ---------------------------------------------------------

HALF_DTYPES = [torch.bfloat16, torch.float16]
T, HIDDEN, H, KV, D, INTER = 512, 4096, 32, 8, 128, 14336


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_gpu_norms(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(10)
    x, residual = randn(T, HIDDEN, gen=gen, dtype=dtype), randn(T, HIDDEN, gen=gen, dtype=dtype)
    weight = randn(HIDDEN, gen=gen, dtype=dtype)
    assert rel_error(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS)) < 1e-2
    expected = fused_add_rms_norm_reference(x.clone(), residual.clone(), weight, EPS)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert normed is x and new_residual is residual
    assert torch.equal(new_residual, expected[1])  # the same bf16/fp16 addition
    assert rel_error(normed, expected[0]) < 1e-2
    _, q, k, _ = split_qkv(T, H, KV, D, gen=gen, dtype=dtype)
    head_weight = randn(D, gen=gen, dtype=dtype)
    for view in (q, k):
        out = rms_norm(view, head_weight, EPS)
        assert rel_error(out, rms_norm_reference(view, head_weight, EPS)) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [1, 3, 96])
def test_gpu_rms_norm_pair(num_tokens: int) -> None:
    """An EAGLE-3 head's input at Qwen3-8B's hidden size, bf16: the same rounding as the two
    norms apart."""
    gen = torch.Generator().manual_seed(12)
    bf16 = torch.bfloat16
    a, b = (randn(num_tokens, HIDDEN, gen=gen, dtype=bf16) for _ in range(2))
    a_weight, b_weight = (randn(HIDDEN, gen=gen, dtype=bf16) for _ in range(2))
    out = rms_norm_pair(a, a_weight, b, b_weight, EPS)
    expected = torch.cat([rms_norm(a, a_weight, EPS), rms_norm(b, b_weight, EPS)], dim=-1)
    assert torch.equal(out, expected)
    assert rel_error(out, rms_norm_pair_reference(a, a_weight, b, b_weight, EPS)) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [1, 96])
def test_gpu_fused_norm_add_rms_norm(num_tokens: int) -> None:
    """At Gemma-3-12B's hidden size (3840), bf16."""
    gen = torch.Generator().manual_seed(11)
    bf16 = torch.bfloat16
    x, residual = (randn(num_tokens, 3840, gen=gen, dtype=bf16) for _ in range(2))
    x_weight, weight = (randn(3840, gen=gen, dtype=bf16) for _ in range(2))
    expected = fused_norm_add_rms_norm_reference(x.clone(), residual.clone(), x_weight, weight, EPS)
    normed, new_residual = fused_norm_add_rms_norm(x, residual, x_weight, weight, EPS)
    assert rel_error(new_residual, expected[1]) < 1e-2
    assert rel_error(normed, expected[0]) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_gpu_silu_and_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    gate_up = randn(T, 2 * INTER, gen=gen, dtype=dtype)
    assert rel_error(silu_and_mul(gate_up), silu_and_mul_reference(gate_up)) < 1e-2
