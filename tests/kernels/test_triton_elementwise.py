"""The small Triton kernels (RMSNorm, RoPE, SiLU-and-mul, KV write) against their torch references.

Inputs are laid out as in the decoder: q/k/v are strided views into one fused qkv output, the
caches are the two halves of one [2, num_blocks, block_size, KV, D] tensor. In-place kernels
must return their inputs and match the reference computed on clones. On CPU the kernels run
under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so CPU shapes are small.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.activation import silu_and_mul_reference
from kernels.cache import write_kv_reference
from kernels.norm import fused_add_rms_norm_reference, rms_norm_reference
from kernels.rotary import rotary_embedding_reference
from kernels.triton_activation import silu_and_mul
from kernels.triton_cache import write_kv
from kernels.triton_norm import fused_add_rms_norm, rms_norm
from kernels.triton_rotary import rotary_embedding
from services.executor.layers import RotaryEmbedding

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


# --- Rotary ------------------------------------------------------------------------------------


@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (3, 3, 40)])
def test_rotary_in_place_on_qkv_views(
    positions_dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(num_heads * head_dim)
    num_tokens, max_position = 11, 64
    rope = RotaryEmbedding(head_dim, max_position, theta=10000.0, scaling=None).to(DEVICE)
    qkv, q, k, v = split_qkv(num_tokens, num_heads, num_kv_heads, head_dim, gen=gen)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen, dtype=positions_dtype)
    positions = positions.to(DEVICE)
    expected_q, expected_k = rotary_embedding_reference(
        positions.long(), q.clone(), k.clone(), rope.cos_sin_cache
    )
    v_before = v.clone()

    q_out, k_out = rotary_embedding(positions, q, k, rope.cos_sin_cache)

    assert q_out is q and k_out is k
    assert q_out.data_ptr() == qkv.data_ptr()  # rotated where it lies in qkv
    torch.testing.assert_close(q_out, expected_q, **TIGHT)
    torch.testing.assert_close(k_out, expected_k, **TIGHT)
    assert torch.equal(v, v_before)  # v shares the buffer and must be untouched


def test_rotary_uses_both_halves_of_the_table() -> None:
    """A table whose halves differ still matches the reference: no half is assumed repeated."""
    gen = torch.Generator().manual_seed(5)
    _, q, k, _ = split_qkv(4, 2, 1, 8, gen=gen)
    cos_sin_cache = randn(16, 2, 8, gen=gen)
    positions = torch.tensor([0, 15, 3, 3], device=DEVICE)
    expected = rotary_embedding_reference(positions, q.clone(), k.clone(), cos_sin_cache)
    q_out, k_out = rotary_embedding(positions, q, k, cos_sin_cache)
    torch.testing.assert_close(q_out, expected[0], **TIGHT)
    torch.testing.assert_close(k_out, expected[1], **TIGHT)


# --- SiLU-and-mul ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 80), (2, 3000), (2, 2, 24)])  # 1500 > one 1024 block
def test_silu_and_mul_matches_reference(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    gate_up = randn(*shape, gen=gen) * 4
    out = silu_and_mul(gate_up)
    assert out.is_contiguous() and out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out, silu_and_mul_reference(gate_up), **TIGHT)


def test_silu_and_mul_strided_rows() -> None:
    gen = torch.Generator().manual_seed(6)
    gate_up = randn(4, 100, gen=gen)[:, :64]  # row stride 100
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), **TIGHT)


# --- KV write ----------------------------------------------------------------------------------


def poisoned_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """[2, num_blocks, block_size, KV, D] of NaN: any slot written by mistake shows."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_skips_padding_and_matches_reference(slot_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    num_tokens, num_kv_heads, head_dim, num_blocks, block_size = 10, 2, 24, 6, 4
    _, _, k, v = split_qkv(num_tokens, 4, num_kv_heads, head_dim, gen=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 5, 9]] = -1  # padding tokens
    slot_mapping = slots.to(device=DEVICE, dtype=slot_dtype)
    kv_cache = poisoned_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32)
    ref_cache = kv_cache.clone()

    write_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping)
    write_kv_reference(k, v, ref_cache[0], ref_cache[1], slot_mapping)

    torch.testing.assert_close(kv_cache, ref_cache, rtol=0, atol=0, equal_nan=True)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, slots, KV, D]
    real = slots >= 0
    torch.testing.assert_close(flat[0, slots[real]], k[real.to(DEVICE)], rtol=0, atol=0)
    torch.testing.assert_close(flat[1, slots[real]], v[real.to(DEVICE)], rtol=0, atol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[real]] = False
    assert flat[:, untouched.to(DEVICE)].isnan().all()  # padding wrote nothing, not even at -1


def test_write_kv_all_padding_writes_nothing() -> None:
    gen = torch.Generator().manual_seed(8)
    _, _, k, v = split_qkv(3, 2, 2, 16, gen=gen)
    kv_cache = poisoned_kv_cache(2, 4, 2, 16, torch.float32)
    write_kv(k, v, kv_cache[0], kv_cache[1], torch.full((3,), -1, device=DEVICE))
    assert kv_cache.isnan().all()


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
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_gpu_rotary(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    rope = RotaryEmbedding(D, 8192, theta=500000.0, scaling=None).to(DEVICE)
    _, q, k, v = split_qkv(T, H, KV, D, gen=gen, dtype=dtype)
    positions = torch.randint(0, 8192, (T,), generator=gen).to(DEVICE)
    expected = rotary_embedding_reference(positions, q.clone(), k.clone(), rope.cos_sin_cache)
    v_before = v.clone()
    q_out, k_out = rotary_embedding(positions.int(), q, k, rope.cos_sin_cache)
    assert q_out is q and k_out is k
    assert rel_error(q_out, expected[0]) < 1e-2 and rel_error(k_out, expected[1]) < 1e-2
    assert torch.equal(v, v_before)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_gpu_silu_and_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    gate_up = randn(T, 2 * INTER, gen=gen, dtype=dtype)
    assert rel_error(silu_and_mul(gate_up), silu_and_mul_reference(gate_up)) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_gpu_write_kv(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(13)
    num_blocks, block_size = 256, 16
    _, _, k, v = split_qkv(T, H, KV, D, gen=gen, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[-64:] = -1  # a padded CUDA-graph batch
    slot_mapping = slots.to(DEVICE)
    kv_cache = poisoned_kv_cache(num_blocks, block_size, KV, D, dtype)
    ref_cache = kv_cache.clone()
    write_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping)
    write_kv_reference(k, v, ref_cache[0], ref_cache[1], slot_mapping)
    torch.testing.assert_close(kv_cache, ref_cache, rtol=0, atol=0, equal_nan=True)
