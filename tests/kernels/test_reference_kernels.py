"""The torch reference kernels against naive oracles, with KV pages scattered at random.

Later Triton kernels are tested against these references, so these must be right first.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul_reference
from kernels.attention import contiguous_attention_reference, paged_attention_reference
from kernels.cache import write_kv_reference
from kernels.norm import fused_add_rms_norm_reference, rms_norm_reference
from kernels.rotary import rotary_embedding_reference
from services.executor.layers.rotary import RotaryEmbedding, rope_inv_freq

BLOCK_SIZE = 8
NUM_BLOCKS = 64


def scatter_contexts(
    contexts: list[tuple[torch.Tensor, torch.Tensor]], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write each request's contiguous K/V into randomly chosen cache blocks."""
    num_kv_heads, head_dim = contexts[0][0].shape[1:]
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"))  # poisoned: reading a wrong slot shows
    value_cache = torch.full(shape, float("nan"))
    # Block 0 pads the tables, and attention may read it for padding rows: keep it finite.
    key_cache[0] = 0.0
    value_cache[0] = 0.0
    free = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()
    tables = []
    for key, value in contexts:
        num_blocks = -(-key.shape[0] // BLOCK_SIZE)
        blocks = [free.pop() for _ in range(num_blocks)]
        positions = torch.arange(key.shape[0])
        slots = torch.tensor(blocks)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        write_kv_reference(key, value, key_cache, value_cache, slots)
        tables.append(blocks)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return key_cache, value_cache, block_tables


@pytest.mark.parametrize(
    ("seq_lens", "query_lens"),
    [
        ([5], [5]),  # one prefill
        ([17, 1, 33], [1, 1, 1]),  # decodes
        ([40, 9, 24, 8], [7, 9, 1, 3]),  # prefix hits + chunks + decode + full prompt
    ],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)])
def test_paged_attention_matches_contiguous(
    seq_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int
) -> None:
    generator = torch.Generator().manual_seed(sum(seq_lens) + num_heads)
    head_dim, scale = 16, 16**-0.5
    contexts = [
        (
            torch.randn(n, num_kv_heads, head_dim, generator=generator),
            torch.randn(n, num_kv_heads, head_dim, generator=generator),
        )
        for n in seq_lens
    ]
    queries = [torch.randn(q, num_heads, head_dim, generator=generator) for q in query_lens]
    key_cache, value_cache, block_tables = scatter_contexts(contexts, generator)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])

    out = paged_attention_reference(
        torch.cat(queries),
        key_cache,
        value_cache,
        block_tables,
        torch.tensor(seq_lens),
        query_start_loc,
        max(query_lens),
        max(seq_lens),
        scale,
    )

    expected = torch.cat(
        [
            contiguous_attention_reference(q, k, v, scale)
            for q, (k, v) in zip(queries, contexts, strict=True)
        ]
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_write_kv_places_each_token_at_its_slot() -> None:
    key = torch.randn(3, 2, 4)
    value = torch.randn(3, 2, 4)
    key_cache = torch.zeros(4, BLOCK_SIZE, 2, 4)
    value_cache = torch.zeros(4, BLOCK_SIZE, 2, 4)
    write_kv_reference(key, value, key_cache, value_cache, torch.tensor([3, 9, 31]))
    torch.testing.assert_close(key_cache[0, 3], key[0])
    torch.testing.assert_close(value_cache[1, 1], value[1])
    torch.testing.assert_close(key_cache[3, 7], key[2])
    assert key_cache.count_nonzero() == key.numel()


def test_write_kv_skips_negative_slots() -> None:
    """A negative slot marks a padding token: its K/V land nowhere, not even at slot -1."""
    key, value = torch.randn(4, 2, 4), torch.randn(4, 2, 4)
    key_cache = torch.full((2, BLOCK_SIZE, 2, 4), float("nan"))
    value_cache = torch.full((2, BLOCK_SIZE, 2, 4), float("nan"))
    slot_mapping = torch.tensor([5, -1, 12, -1], dtype=torch.int32)
    write_kv_reference(key, value, key_cache, value_cache, slot_mapping)
    torch.testing.assert_close(key_cache[0, 5], key[0])
    torch.testing.assert_close(value_cache[1, 4], value[2])
    assert key_cache.isnan().sum() == key_cache.numel() - 2 * key[0].numel()
    assert value_cache.isnan().sum() == value_cache.numel() - 2 * value[0].numel()


def test_rms_norm_matches_formula() -> None:
    x, weight = torch.randn(5, 32), torch.randn(32)
    expected = weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm_reference(x, weight, 1e-6), expected)
    residual = torch.randn(5, 32)
    normed, new_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, rms_norm_reference(x + residual, weight, 1e-6))


def test_silu_and_mul() -> None:
    gate_up = torch.randn(3, 20)
    torch.testing.assert_close(
        silu_and_mul_reference(gate_up), F.silu(gate_up[:, :10]) * gate_up[:, 10:]
    )


def test_rotary_rotates_each_pair_by_position_times_frequency() -> None:
    head_dim, theta = 8, 10000.0
    rope = RotaryEmbedding(head_dim, max_position=64, theta=theta, scaling=None)
    positions = torch.tensor([0, 5, 63])
    q, k = torch.randn(3, 2, head_dim), torch.randn(3, 1, head_dim)
    q_out, k_out = rotary_embedding_reference(positions, q, k, rope.cos_sin_cache)
    # Oracle: dims (i, i + half) form a complex number rotated by angle pos * inv_freq[i].
    half = head_dim // 2
    angles = positions[:, None].float() * rope_inv_freq(head_dim, theta, None)[None, :]
    for x, out in ((q, q_out), (k, k_out)):
        z = (
            torch.complex(x[..., :half], x[..., half:])
            * torch.polar(torch.ones_like(angles), angles)[:, None, :]
        )
        torch.testing.assert_close(out, torch.cat((z.real, z.imag), dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_out[0], q[0])  # position 0 is the identity


def test_llama3_scaling_slows_only_low_frequencies() -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    plain = rope_inv_freq(128, 500000.0, None)
    scaled = rope_inv_freq(128, 500000.0, scaling)
    assert torch.equal(scaled[:8], plain[:8])  # high frequencies untouched
    torch.testing.assert_close(scaled[-8:], plain[-8:] / 8.0)  # low frequencies / factor
    assert torch.all(scaled <= plain)


@pytest.mark.parametrize(
    "params",
    [
        # gpt-oss's: its ramp's ends not rounded (truncate false)
        dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096,
             truncate=False),
        dict(factor=4.0, original_max_position_embeddings=32768),  # Qwen3's long context
        dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
             mscale_all_dim=1.0),  # mscale's ratio (1 here)
    ],
    ids=["gpt-oss", "qwen3", "mscale"],
)  # fmt: skip
def test_yarn_table_matches_transformers(params: dict) -> None:
    """The cos/sin table of YaRN scaling: transformers' inverse frequencies and attention
    factor, for its configs' variants."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, head_dim = 150000.0, 64
    rope = {"rope_type": "yarn", "rope_theta": theta, **params}
    config = transformers.Qwen3Config(
        head_dim=head_dim, hidden_size=256, num_attention_heads=4,
        max_position_embeddings=131072, rope_parameters=rope,
    )  # fmt: skip
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    table = RotaryEmbedding(head_dim, 300, theta, rope).cos_sin_cache
    angles = torch.arange(300).float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    torch.testing.assert_close(table[:, 0], angles.cos() * factor)
    torch.testing.assert_close(table[:, 1], angles.sin() * factor)


def test_mxfp4_dequantization_matches_transformers() -> None:
    """gpt-oss's MXFP4 blocks and scales: the values transformers' own conversion gives
    (which also transposes them to [E, in, out])."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    from kernels.mxfp4 import dequantize_mxfp4

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(118, 136, (2, 6, 3), generator=generator, dtype=torch.uint8)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs)
