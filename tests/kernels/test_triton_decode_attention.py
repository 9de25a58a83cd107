"""The Triton decode attention kernel against the torch paged reference, pages scattered at random.

On CPU the kernel runs under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before anything imports triton), so the CPU cases keep shapes small.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import triton_split_k as split_k
from kernels.attention import paged_attention_reference
from kernels.triton_decode_attention import (
    INVARIANT_SPLIT_TOKENS,
    MAX_SPLITS,
    SPLIT_BALANCE,
    DecodeTiles,
    _decode_partition_kernel,
    _split_rule,
    _split_tokens,
    _splits,
    compile_every_variant,
    default_decode_tiles,
    paged_decode_attention,
)
from tests.kernels.paged_cache import BLOCK_SIZE, scattered_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    key_cache, value_cache, block_tables = scattered_cache(
        seq_lens, num_kv_heads, head_dim, dtype, generator, block_size
    )
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    tensors = (query, key_cache, value_cache, block_tables, lens)
    return tuple(t.to(DEVICE) for t in tensors)


def reference(query, key_cache, value_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    num_reqs = query.shape[0]
    query_start_loc = torch.arange(num_reqs + 1, device=query.device, dtype=torch.int32)
    return paged_attention_reference(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        scale=scale,
    )  # [R, H, D]


SEQ_LENS = [1, 37, 100, 16, 5]  # a lone token, non-multiples of 16, a full block, several splits


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    query, key_cache, value_cache, block_tables, seq_lens = make_case(
        SEQ_LENS, num_heads, num_kv_heads, head_dim, torch.float32, seed=num_heads + head_dim
    )
    scale = head_dim**-0.5
    expected = reference(query, key_cache, value_cache, block_tables, seq_lens, scale)
    assert torch.isfinite(expected).all()
    for num_splits in (1, 3, None):
        out = paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, scale, num_splits=num_splits
        )
        assert out.shape == query.shape and out.dtype == query.dtype
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4, msg=f"{num_splits=}")


def test_split_count_does_not_change_result() -> None:
    query, key_cache, value_cache, block_tables, seq_lens = make_case(
        [70, 3], 8, 2, 64, torch.float32, seed=7
    )
    one = paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, 0.125, 1)
    # Request 0 in 5 splits of one block (70 tokens); request 1 in one, leaving four empty.
    many = paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, 0.125, 5)
    torch.testing.assert_close(many, one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (16, 2)])
def test_merge_of_many_splits_matches_reference(num_heads: int, num_kv_heads: int) -> None:
    """The last program of a (request, KV head) merges its live splits a chunk at a time:
    4096 // (GROUP rounded up to a power of two x head_dim) per step, 64 for a group of 1, so
    more splits than a chunk holds (1,100 tokens in splits of one block: 69 live), groups
    of 1, 3 (padded to 4) and 8, and empty splits past the shorter contexts."""
    query, key_cache, value_cache, block_tables, seq_lens = make_case(
        [1100, 40, 1], num_heads, num_kv_heads, 64, torch.float32, seed=num_heads
    )
    # The first request's last block scores highest: the running max moves in the last chunk.
    group_queries = query[0].view(num_kv_heads, num_heads // num_kv_heads, 64)
    key_cache[block_tables[0, 1099 // BLOCK_SIZE]] = 2 * group_queries.mean(dim=1)
    expected = reference(query, key_cache, value_cache, block_tables, seq_lens, 0.125)
    splits = block_tables.shape[1]  # a block each
    out = paged_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, 0.125, splits
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert not split_k.tickets(query.device).any()  # zero again for the next launch


def test_rejects_head_dim_not_power_of_two() -> None:
    query, key_cache, value_cache, block_tables, seq_lens = make_case(
        [4], 2, 2, 48, torch.float32, seed=0
    )
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, 1.0)


def test_rejects_rows_that_do_not_match_requests() -> None:
    query, key_cache, value_cache, block_tables, seq_lens = make_case(
        [4, 9], 2, 2, 64, torch.float32, seed=0
    )
    args = (key_cache, value_cache, block_tables, seq_lens, 1.0)
    with pytest.raises(ValueError, match="one token per request"):
        paged_decode_attention(torch.cat([query, query]), *args)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_decode_attention(query, *args, query_start_loc=seq_lens)
    with pytest.raises(ValueError, match="out"):
        paged_decode_attention(query, *args, out=query[:1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_bf16_real_shapes() -> None:
    generator = torch.Generator().manual_seed(1)
    seq_lens = torch.randint(1, 4097, (64,), generator=generator)
    seq_lens[:4] = torch.tensor([1, 4096, 4095, 17])
    query, key_cache, value_cache, block_tables, lens = make_case(
        seq_lens.tolist(), 32, 8, 128, torch.bfloat16, seed=2
    )
    scale = 128**-0.5
    expected = reference(query, key_cache, value_cache, block_tables, lens, scale)
    for num_splits in (1, 8, None):
        out = paged_decode_attention(
            query, key_cache, value_cache, block_tables, lens, scale, num_splits=num_splits
        )
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2, msg=f"{num_splits=}")


@pytest.mark.parametrize(
    "tiles", [DecodeTiles(32, 2, 1), DecodeTiles(128, 8, 4)], ids=["tile32", "tile128"]
)
def test_tiles_do_not_change_result(tiles: DecodeTiles) -> None:
    # Tiles smaller and larger than the default 64 tokens, with 3 splits given (100 tokens in
    # splits of 48: tiles of 32 cross split ends) and the picked count (tile-aware).
    query, key_cache, value_cache, block_tables, seq_lens = make_case(
        SEQ_LENS, 8, 2, 64, torch.float32, seed=11
    )
    expected = reference(query, key_cache, value_cache, block_tables, seq_lens, 0.125)
    for num_splits in (3, None):
        out = paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, 0.125, num_splits, tiles=tiles
        )
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4, msg=f"{num_splits=}")


def test_default_tiles_are_64_tokens_128_for_fp8_or_one_block() -> None:
    assert default_decode_tiles(torch.bfloat16, 16) == DecodeTiles(64, 4, 3)
    assert default_decode_tiles(torch.bfloat16, 128).tile == 128
    assert default_decode_tiles(torch.float8_e4m3fn, 16) == DecodeTiles(128, 4, 3)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"tile": 48}, "tile"),
        ({"tile": 8}, "tile"),
        ({"num_warps": 3}, "num_warps"),
        ({"num_stages": 0}, "num_stages"),
    ],
)
def test_rejects_invalid_tiles(fields: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=f"DecodeTiles.{match}"):
        DecodeTiles(**fields)


def test_a_tile_may_be_smaller_than_a_block() -> None:
    # Each position looks up its own block: 16-token tiles over 32-token blocks.
    query, key_cache, value_cache, block_tables, seq_lens = make_case(
        SEQ_LENS, 8, 2, 64, torch.float32, seed=12, block_size=32
    )
    expected = reference(query, key_cache, value_cache, block_tables, seq_lens, 0.125)
    out = paged_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, 0.125, tiles=DecodeTiles(16)
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def _num_compiled() -> int:
    """Triton's compiled variants of the kernel, on every device (its JIT cache)."""
    return sum(len(cache[0]) for cache in _decode_partition_kernel.device_caches.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the JIT cache)")
def test_after_compiling_every_variant_no_split_count_compiles() -> None:
    """Split counts and block table widths are runtime values: once `compile_every_variant`
    ran, decode and mixed batches of any split count launch without a compile."""
    query, key_cache, value_cache, block_tables, lens = make_case(
        [200, 37, 1000], 32, 8, 128, torch.bfloat16, seed=5
    )
    compile_every_variant(query, key_cache, value_cache)
    compiled = _num_compiled()
    mixed = torch.arange(4, device=DEVICE, dtype=torch.int32)
    for num_splits in [None, *range(1, MAX_SPLITS + 1)]:  # None: the picked arguments
        for width in (block_tables.shape[1], 17):
            tables = block_tables[:, :width].contiguous()
            for loc in (None, mixed):
                paged_decode_attention(
                    query, key_cache, value_cache, tables, lens, 0.1, num_splits,
                    query_start_loc=loc,
                )  # fmt: skip
    assert _num_compiled() == compiled


@triton.jit
def _split_tokens_of(
    seq_lens_ptr, out_ptr, n, num_splits, split_balance, min_split_tokens, fixed,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, N: tl.constexpr,
):  # fmt: skip
    i = tl.arange(0, N)
    seq_lens = tl.load(seq_lens_ptr + i, mask=i < n, other=1)
    tokens = _split_tokens(
        seq_lens, num_splits, split_balance, min_split_tokens, fixed, BLOCK_SIZE, TILE
    )
    tl.store(out_ptr + i, tokens, mask=i < n)


def split_tokens(
    seq_lens: list[int],
    num_splits: int,
    balance: int,
    least: int = 0,
    tile: int = 64,
    fixed: int = 0,
) -> list[int]:
    """The kernel's context tokens a split for each context (its own device function), with
    blocks of 16 tokens."""
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(lens)
    size = triton.next_power_of_2(len(seq_lens))
    args = (lens, out, len(seq_lens), num_splits, balance, least, fixed, 16, tile, size)
    _split_tokens_of[(1,)](*args)
    return out.tolist()


def test_picked_splits_follow_the_context_not_the_table_width() -> None:
    """At batch 1 (64 splits launched) 256, 1,024, 4,096, 16,384 and 32,768 tokens of context
    take 4, 8, 16, 32 and 43 splits, whatever the model's context bound; before, the table's
    width cut them (a 4,096-token context ran 64 splits at a 4,096-token bound, and one at
    Llama-3.1's 131,072). Where the launch has fewer splits than that, the floor decides."""
    lens = [256, 1024, 4096, 16384, 32768]
    for width_split in (64, 2048):
        tokens = split_tokens(lens, MAX_SPLITS, SPLIT_BALANCE, width_split)
        assert tokens == [64, 128, 256, 512, 768]
        assert [triton.cdiv(c, t) for c, t in zip(lens, tokens, strict=True)] == [4, 8, 16, 32, 43]
    # 16 balanced splits wanted, 9 launched: the table's share near its width (4,096 tokens),
    # an even share within half of it (131,072).
    assert split_tokens([3900], 9, SPLIT_BALANCE, 464) == [464]
    assert split_tokens([3900], 9, SPLIT_BALANCE, 14576) == [448]


@settings(max_examples=25, deadline=None)
@given(
    seq_lens=st.lists(st.integers(1, 1 << 17), min_size=1, max_size=16),
    num_splits=st.integers(1, MAX_SPLITS),
    balance=st.sampled_from([0, SPLIT_BALANCE]),
    least=st.sampled_from([0, 16, 1024, 43696]),  # 0, or cdiv(width in blocks, splits) blocks
    tile=st.sampled_from([16, 64, 128]),
)
def test_splits_hold_the_context_in_whole_blocks(
    seq_lens: list[int], num_splits: int, balance: int, least: int, tile: int
) -> None:
    tokens_of = split_tokens(seq_lens, num_splits, balance, least, tile)
    for seq_len, tokens in zip(seq_lens, tokens_of, strict=True):
        assert tokens % 16 == 0 and triton.cdiv(seq_len, tokens) <= num_splits
        balanced = max(1, triton.cdiv(int((balance * seq_len) ** 0.5), tile)) * tile
        even = triton.cdiv(triton.cdiv(seq_len, num_splits), 16) * 16
        if balance and triton.cdiv(seq_len, balanced) <= num_splits:  # whole tiles
            assert tokens == balanced
        elif balance and 2 * seq_len <= num_splits * least:  # within half the table
            assert tokens == even
        else:  # as even as whole blocks allow, with the floor
            assert tokens == max(even, least)


def test_a_long_context_in_its_balanced_splits_matches_reference() -> None:
    """600 tokens in the balanced splits of the picked count (five of 128, by the rule
    asserted first), merged, match the reference."""
    query, key_cache, value_cache, block_tables, seq_lens = make_case(
        [600, 37], 8, 2, 64, torch.float32, seed=21
    )
    assert split_tokens([600], MAX_SPLITS, SPLIT_BALANCE) == [128]
    expected = reference(query, key_cache, value_cache, block_tables, seq_lens, 0.125)
    out = paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert not split_k.tickets(query.device).any()


def test_a_batch_that_fills_the_gpu_splits_by_the_table_width() -> None:
    """Picked splits: up to a (request, KV head) pair an SM (8 on CPU) a context takes its
    balanced splits; past that a split covers at least 1/num_splits of the table's width.
    A given count: even shares, no floor."""
    cpu = torch.device("cpu")
    assert _split_rule(8, cpu) == SPLIT_BALANCE and _split_rule(9, cpu) == 0
    assert _splits(None, 1, 8, 256, 16, cpu, 64, False) == (4, SPLIT_BALANCE, 1024, 0)
    assert _splits(None, 2, 8, 256, 16, cpu, 64, False) == (2, 0, 2048, 0)
    assert _splits(5, 2, 8, 256, 16, cpu, 64, False) == (5, 0, 0, 0)


def test_invariant_splits_follow_the_position_alone() -> None:
    """--batch-invariant: the launch holds the table in splits of 256 tokens (at most
    MAX_SPLITS), and a context takes 256-token splits, doubled only past 64 of them, whatever
    the batch, the table's width or the split count launched for a shorter table."""
    cpu = torch.device("cpu")
    assert _splits(None, 1, 8, 256, 16, cpu, 64, True) == (16, 0, 0, INVARIANT_SPLIT_TOKENS)
    assert _splits(None, 9, 8, 8192, 16, cpu, 128, True) == (MAX_SPLITS, 0, 0, 256)
    lens = [1, 255, 256, 4000, 16384, 16385, 40000]
    expected = [256, 256, 256, 256, 256, 512, 1024]
    assert split_tokens(lens, MAX_SPLITS, 0, fixed=256) == expected
    assert split_tokens(lens[:4], 16, SPLIT_BALANCE, 1024, fixed=256) == expected[:4]


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_windows_match_the_reference(window: int) -> None:
    """The splits share only the window's positions: contexts shorter and far longer than the
    window (1,100 tokens: the splits' merge after a window of 16 or 40), every split count."""
    seq_lens = [*SEQ_LENS, 1100]
    query, key_cache, value_cache, block_tables, lens = make_case(
        seq_lens, 8, 2, 64, torch.float32, seed=window
    )
    num_reqs = query.shape[0]
    case = dict(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
        seq_lens=lens, query_start_loc=torch.arange(num_reqs + 1, device=DEVICE,
                                                    dtype=torch.int32),
        max_query_len=1, max_seq_len=max(seq_lens), scale=0.125,
    )  # fmt: skip
    expected = paged_attention_reference(**case, window=window)
    for num_splits in (1, 3, None):
        out = paged_decode_attention(
            query, key_cache, value_cache, block_tables, lens, 0.125, num_splits, window=window
        )
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4, msg=f"{num_splits=}")


@pytest.mark.parametrize("window", [2, 9])
def test_sliding_windows_of_a_verifying_rows_queries(window: int) -> None:
    """A mixed batch's requests of up to three query tokens (a verifying row): each query's
    own window, the first query's reaching furthest back."""
    generator = torch.Generator().manual_seed(window)
    counts, seq_lens = [3, 1, 2, 3], [40, 17, 90, 3]
    key_cache, value_cache, block_tables = scattered_cache(seq_lens, 2, 64, torch.float32,
                                                           generator)  # fmt: skip
    query = torch.randn(sum(counts), 8, 64, generator=generator)
    starts = torch.tensor([0, *counts]).cumsum(0).to(torch.int32)
    case = dict(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=starts,
        max_query_len=3, max_seq_len=max(seq_lens), scale=0.125,
    )  # fmt: skip
    case = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    expected = paged_attention_reference(**case, window=window)
    args = [case[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
    for num_splits in (1, 4):
        out = paged_decode_attention(
            *args, 0.125, num_splits, query_start_loc=case["query_start_loc"], max_queries=3,
            window=window,
        )  # fmt: skip
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4, msg=f"{num_splits=}")


@pytest.mark.parametrize("window", [None, 16])
def test_attention_sinks_match_the_reference(window: int | None) -> None:
    """gpt-oss's sinks in the one-split path and in the merge of many (1,100 tokens)."""
    seq_lens = [*SEQ_LENS, 1100]
    query, key_cache, value_cache, block_tables, lens = make_case(
        seq_lens, 8, 2, 64, torch.float32, seed=9
    )
    sinks = torch.tensor([0.0, 3.0, -2.0, 20.0, -30.0, 1.0, 0.5, -1.0], device=DEVICE)
    num_reqs = query.shape[0]
    starts = torch.arange(num_reqs + 1, device=DEVICE, dtype=torch.int32)
    expected = paged_attention_reference(
        query, key_cache, value_cache, block_tables, lens, starts, 1, max(seq_lens), 0.125,
        window, sinks,
    )  # fmt: skip
    for num_splits in (1, 3, None):
        out = paged_decode_attention(
            query, key_cache, value_cache, block_tables, lens, 0.125, num_splits,
            window=window, sinks=sinks,
        )  # fmt: skip
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4, msg=f"{num_splits=}")


@pytest.mark.parametrize("window", [None, 16])
def test_soft_capped_scores_match_the_reference(window: int | None) -> None:
    """Gemma 2's soft-capping in the one-split path and in the merge of many (1,100 tokens)."""
    seq_lens = [*SEQ_LENS, 1100]
    query, key_cache, value_cache, block_tables, lens = make_case(
        seq_lens, 8, 2, 64, torch.float32, seed=10
    )
    num_reqs = query.shape[0]
    starts = torch.arange(num_reqs + 1, device=DEVICE, dtype=torch.int32)
    args = (query, key_cache, value_cache, block_tables, lens, starts, 1, max(seq_lens), 0.125)
    expected = paged_attention_reference(*args, window, softcap=0.5)
    assert not torch.allclose(expected, paged_attention_reference(*args, window))
    for num_splits in (1, 3, None):
        out = paged_decode_attention(
            query, key_cache, value_cache, block_tables, lens, 0.125, num_splits,
            window=window, softcap=0.5,
        )  # fmt: skip
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4, msg=f"{num_splits=}")
