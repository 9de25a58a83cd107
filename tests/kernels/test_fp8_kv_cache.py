"""An FP8 (e4m3) KV cache, with and without scales: the fused rotary + cache write stores what
the reference stores, and both attention kernels read it as the reference does (under the
interpreter on CPU, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import triton_decode_attention
from kernels.attention import paged_attention_reference
from kernels.cache import to_cache_dtype
from kernels.rotary_cache import rotary_write_kv_reference
from kernels.triton_decode_attention import paged_decode_attention
from kernels.triton_prefill_attention import paged_prefill_attention
from kernels.triton_rotary_cache import rotary_write_kv
from services.executor.layers.rotary import RotaryEmbedding
from tests.kernels import test_triton_decode_attention as decode_tests
from tests.kernels import test_triton_prefill_attention as prefill_tests

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
FP8 = torch.float8_e4m3fn


def test_values_past_the_range_saturate_instead_of_becoming_nan() -> None:
    x = torch.tensor([1000.0, -1000.0, 0.3, 448.0])
    assert to_cache_dtype(x, FP8).float().tolist() == [448.0, -448.0, 0.3125, 448.0]


def test_a_scale_divides_what_the_cache_stores() -> None:
    x = torch.tensor([1.0, -30.0, 0.3])
    assert to_cache_dtype(x, FP8, 0.1).float().tolist() == [10.0, -288.0, 3.0]
    with pytest.raises(ValueError, match="KV scales apply to an FP8 cache"):
        to_cache_dtype(x, torch.bfloat16, 0.1)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 0.5)], ids=["unscaled", "scaled"])
def test_rotary_write_stores_what_the_reference_stores(
    qk_norm: bool, scales: tuple[float, float]
) -> None:
    generator = torch.Generator().manual_seed(int(qk_norm))
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 9, 4, 2, 64, 4
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    qkv[:, -head_dim:] *= 300.0  # the last value head: many values past e4m3's 448
    qkv = qkv.to(DEVICE, DTYPE)
    kv_size = num_kv_heads * head_dim
    q, k, v = qkv.split([num_heads * head_dim, kv_size, kv_size], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 500, (num_tokens,), generator=generator).to(DEVICE)
    slots = torch.randperm(6 * block_size, generator=generator)[:num_tokens].to(DEVICE)
    slots[2] = -1  # padding: written nowhere
    table = RotaryEmbedding(head_dim, 512, 10000.0, None).cos_sin_cache.to(DEVICE)
    weights = (torch.rand(head_dim) + 0.5).to(DEVICE, DTYPE) if qk_norm else None
    caches = []
    for kernel in (rotary_write_kv_reference, rotary_write_kv):
        cache = torch.full((2, 6, block_size, num_kv_heads, head_dim), float("nan"), device=DEVICE)
        cache = cache.to(FP8)
        kernel(
            positions, q.clone(), k, v, table, cache[0], cache[1], slots, weights, weights,
            1e-6, *scales,
        )  # fmt: skip
        caches.append(cache.float())
    expected, out = caches
    written = ~expected.isnan()
    assert torch.equal(written, ~out.isnan())  # the same slots, and no NaN from saturation
    assert expected[written].abs().max() == 448.0
    if DTYPE is torch.float32:
        # The same e4m3 values, but for a value the two rotations (summed in another order)
        # put on either side of a rounding boundary: one e4m3 step apart.
        same = expected[written] == out[written]
        assert same.float().mean() > 0.99
        step = expected[written].abs().clamp(min=2.0**-6) * 2.0**-3
        assert ((expected[written] - out[written]).abs() <= step).all()
    else:
        # In bf16 the reference norms and rotates in bf16, the kernel in float32 (as in
        # test_triton_rotary_cache): judged as a whole.
        error = (expected[written] - out[written]).norm() / expected[written].norm()
        assert error.item() < 3e-2


def test_the_fused_write_stores_keys_and_values_divided_by_their_scales() -> None:
    """Against the unscaled values (a float32 cache), divided and rounded here by hand."""
    generator = torch.Generator().manual_seed(5)
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 6, 2, 2, 32, 4
    q = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(DEVICE, DTYPE)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE, DTYPE)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE, DTYPE)
    positions = torch.arange(num_tokens, device=DEVICE)
    slots = torch.arange(num_tokens, device=DEVICE)
    table = RotaryEmbedding(head_dim, 64, 10000.0, None).cos_sin_cache.to(DEVICE)
    shape = (2, 2, block_size, num_kv_heads, head_dim)
    plain = torch.zeros(shape, device=DEVICE, dtype=DTYPE)
    rotary_write_kv_reference(positions, q.clone(), k, v, table, plain[0], plain[1], slots)
    scaled = torch.zeros(shape, device=DEVICE).to(FP8)
    k_scale, v_scale = 0.01, 8.0  # keys spread over e4m3's range, values into its subnormals
    rotary_write_kv(
        positions, q.clone(), k, v, table, scaled[0], scaled[1], slots, None, None, 1e-6,
        k_scale, v_scale,
    )  # fmt: skip
    for stored, value, scale in ((scaled[0], plain[0], k_scale), (scaled[1], plain[1], v_scale)):
        by_hand = (value.float() * (1.0 / scale)).clamp(-448, 448).to(FP8).float()
        if DTYPE is torch.float32:  # the same values but for rounding boundaries: one step
            step = by_hand.abs().clamp(min=2.0**-6) * 2.0**-3
            assert ((stored.float() - by_hand).abs() <= step).all()
            assert (stored.float() == by_hand).float().mean() > 0.9
        else:  # the reference rotates in bf16, the kernel in float32: judged as a whole
            error = (stored.float() - by_hand).norm() / by_hand.norm()
            assert error.item() < 3e-2
    with pytest.raises(ValueError, match="KV scales apply to an FP8 cache"):
        rotary_write_kv(
            positions, q.clone(), k, v, table, plain[0], plain[1], slots, None, None, 1e-6, 0.5
        )


def test_decode_reads_the_fp8_cache_as_the_reference() -> None:
    query, key_cache, value_cache, tables, lens = decode_tests.make_case(
        decode_tests.SEQ_LENS, 8, 2, 64, torch.float32, seed=3
    )
    key_cache, value_cache = key_cache.to(FP8), value_cache.to(FP8)
    query = query.to(DTYPE)
    expected = decode_tests.reference(query, key_cache, value_cache, tables, lens, 0.125)
    out = paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.125)
    tolerance = 2e-2 if torch.bfloat16 == DTYPE else 1e-4
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_decode_reads_the_fp8_cache_at_real_shapes(dtype: torch.dtype) -> None:
    # Llama-3.1-8B's heads, contexts of 1 to 4096 tokens (tails of a tile and of a block),
    # every split count kind; on Hopper the cache is read as words (_e4m3_tile).
    generator = torch.Generator().manual_seed(7)
    seq_lens = torch.randint(1, 4097, (48,), generator=generator)
    seq_lens[:4] = torch.tensor([1, 4096, 4095, 129])
    query, key_cache, value_cache, tables, lens = decode_tests.make_case(
        seq_lens.tolist(), 32, 8, 128, torch.float32, seed=8
    )
    key_cache, value_cache = key_cache.to(FP8), value_cache.to(FP8)
    query = query.to(dtype)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert triton_decode_attention._reads_e4m3_words(query, key_cache, value_cache) == hopper
    expected = decode_tests.reference(query, key_cache, value_cache, tables, lens, 128**-0.5)
    for num_splits in (1, 8, None):
        out = paged_decode_attention(
            query, key_cache, value_cache, tables, lens, 128**-0.5, num_splits=num_splits
        )
        torch.testing.assert_close(
            out.float(), expected.float(), atol=2e-2, rtol=2e-2, msg=f"{num_splits=}"
        )


@pytest.mark.parametrize("batch", list(prefill_tests.BATCHES))
def test_prefill_reads_the_fp8_cache_as_the_reference(batch: str) -> None:
    case = prefill_tests.make_case(prefill_tests.BATCHES[batch], 8, 2, 64, torch.float32, seed=5)
    for name in ("key_cache", "value_cache"):
        case[name] = case[name].to(FP8)
    case["query"] = case["query"].to(DTYPE)
    expected = paged_attention_reference(**case)
    out = paged_prefill_attention(**case)
    tolerance = 2e-2 if torch.bfloat16 == DTYPE else 1e-4
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
