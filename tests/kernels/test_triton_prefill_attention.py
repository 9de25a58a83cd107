"""The Triton mixed-batch attention kernel against the torch paged reference, pages scattered.

On CPU the kernel runs under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before anything imports triton), so the CPU cases keep shapes small. A request is written
(num_queries, seq_len): (n, n) is a fresh prompt, (n, s > n) a chunk after a cached prefix,
(1, s) a decode.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from kernels.attention import paged_attention_reference
from kernels.triton_decode_attention import paged_decode_attention
from kernels.triton_prefill_attention import PrefillTiles, paged_prefill_attention
from tests.kernels.paged_cache import scattered_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(
    requests: list[tuple[int, int]],  # (num_queries, seq_len) per request
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
) -> dict[str, torch.Tensor | int | float]:
    """Keyword arguments for `paged_prefill_attention` and the reference."""
    generator = torch.Generator().manual_seed(seed)
    num_queries = [q for q, _ in requests]
    seq_lens = [s for _, s in requests]
    key_cache, value_cache, block_tables = scattered_cache(
        seq_lens, num_kv_heads, head_dim, dtype, generator
    )
    query_shape = (sum(num_queries), num_heads, head_dim)
    query = torch.randn(query_shape, generator=generator).to(dtype)
    query_start_loc = torch.tensor([0, *num_queries], dtype=torch.int32).cumsum(0)
    tensors = dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=query_start_loc.to(torch.int32),
    )
    return {
        **{name: t.to(DEVICE) for name, t in tensors.items()},
        "max_query_len": max(num_queries),
        "max_seq_len": max(seq_lens),
        "scale": head_dim**-0.5,
    }


BATCHES = {
    # lengths off the tile and block sizes, a one-token prompt, a multi-tile prompt
    "prefill": [(37, 37), (16, 16), (5, 5), (70, 70), (1, 1)],
    # chunks after cached prefixes, one prefix ending mid-block
    "chunked": [(20, 90), (33, 50), (16, 64)],
    # decodes beside prompts and a chunk; a request with no queries this step
    "mixed": [(1, 40), (25, 25), (1, 1), (0, 9), (12, 60), (1, 17)],
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_reference(batch: str, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    case = make_case(
        BATCHES[batch], num_heads, num_kv_heads, head_dim, torch.float32, seed=num_heads + head_dim
    )
    expected = paged_attention_reference(**case)
    assert torch.isfinite(expected).all()
    out = paged_prefill_attention(**case)
    assert out.shape == case["query"].shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "tiles",
    [
        PrefillTiles(block_m=16, block_n=16, num_warps=4, num_stages=2),  # many tiles each way
        PrefillTiles(block_m=128, block_n=128, num_warps=8, num_stages=3),  # the bf16 default
        PrefillTiles(block_m=16, block_n=64, num_warps=4, num_stages=2),  # wide context steps
    ],
    ids=lambda t: f"m{t.block_m}-n{t.block_n}",
)
def test_tile_shapes_do_not_change_result(tiles: PrefillTiles) -> None:
    """Full (unmasked) and diagonal steps fall at many offsets; GQA group 3 pads to 4 rows."""
    case = make_case(BATCHES["mixed"] + BATCHES["chunked"], 6, 2, 64, torch.float32, seed=3)
    expected = paged_attention_reference(**case)
    out = paged_prefill_attention(**case, tiles=tiles)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [1, 7, 16, 40])
@pytest.mark.parametrize(
    "tiles",
    [PrefillTiles(16, 16, 4, 2), PrefillTiles(32, 32, 4, 2)],
    ids=lambda t: f"m{t.block_m}-n{t.block_n}",
)
def test_sliding_windows_match_the_reference(window: int, tiles: PrefillTiles) -> None:
    """A window of 1 (each query its own key), windows inside a tile and across several, over
    prompts longer than the window, chunks whose window starts in the cached prefix, and
    decodes."""
    case = make_case(BATCHES["mixed"] + BATCHES["chunked"], 6, 2, 64, torch.float32, seed=window)
    expected = paged_attention_reference(**case, window=window)
    assert not torch.allclose(expected, paged_attention_reference(**case))
    out = paged_prefill_attention(**case, tiles=tiles, window=window)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_padded_step_matches_unpadded() -> None:
    """A CUDA graph's padded step: extra requests with no queries and extra tokens owned by no
    request, launched as the largest step; the owned rows are what the unpadded step gives."""
    case = make_case(BATCHES["mixed"], 8, 2, 64, torch.float32, seed=11)
    expected = paged_attention_reference(**case)
    num_tokens, num_reqs = case["query"].shape[0], case["seq_lens"].shape[0]
    pad_tokens, pad_reqs = 9, 5
    padded = dict(case)
    padded["query"] = torch.cat([case["query"], torch.randn(pad_tokens, 8, 64, device=DEVICE)])
    padded["seq_lens"] = torch.cat(
        [case["seq_lens"], torch.zeros(pad_reqs, dtype=torch.int32, device=DEVICE)]
    )
    last = case["query_start_loc"][-1:]
    padded["query_start_loc"] = torch.cat([case["query_start_loc"], last.repeat(pad_reqs)])
    padded["block_tables"] = torch.cat(
        [case["block_tables"], case["block_tables"][:1].repeat(pad_reqs, 1)]
    )
    padded["max_query_len"] = num_tokens + pad_tokens  # as captured: the largest possible
    out = paged_prefill_attention(**padded)
    assert out.shape[0] == num_tokens + pad_tokens and num_reqs + pad_reqs == 11
    torch.testing.assert_close(out[:num_tokens], expected, atol=1e-4, rtol=1e-4)


def split_mixed(
    case: dict[str, torch.Tensor | int | float], max_queries: int = 1, num_splits: int | None = None
) -> torch.Tensor:
    """ops.paged_attention's mixed step: prompts here, requests of up to `max_queries` tokens
    by the decode kernel."""
    out = paged_prefill_attention(**case, skip_queries_up_to=max_queries)
    args = [case[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
    return paged_decode_attention(
        *args, case["scale"], num_splits, query_start_loc=case["query_start_loc"], out=out,
        max_queries=max_queries,
    )  # fmt: skip


@pytest.mark.parametrize("batch", ["prefill", "mixed"])
def test_decodes_split_off_match_reference(batch: str) -> None:
    """Each kernel writes its own rows: every row ends up as the reference's, each row once."""
    case = make_case(BATCHES[batch], 8, 2, 64, torch.float32, seed=13)
    expected = paged_attention_reference(**case)
    torch.testing.assert_close(split_mixed(case), expected, atol=1e-4, rtol=1e-4)
    # The decode kernel leaves the prompts' rows as they were, and only those.
    single = (case["query_start_loc"].diff() == 1).nonzero().flatten()
    rows = case["query_start_loc"][single].long()
    args = [case[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
    sentinel = torch.full_like(case["query"], 7.0)
    out = paged_decode_attention(
        *args, case["scale"], query_start_loc=case["query_start_loc"], out=sentinel.clone()
    )
    written = (out != sentinel).any(dim=(1, 2)).nonzero().flatten()
    assert written.tolist() == rows.tolist() and len(rows) > 0
    torch.testing.assert_close(out[rows], expected[rows], atol=1e-4, rtol=1e-4)


# Speculative decoding's verifying rows (a token and its drafts) beside decodes and a prompt;
# 65 tokens of context end one past a block: split past the early queries' own positions.
VERIFYING = [(4, 40), (1, 17), (3, 65), (25, 25), (4, 4), (2, 33), (0, 9)]


@pytest.mark.parametrize("num_splits", [None, 8])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (6, 2), (4, 4)])
def test_verifying_rows_read_as_decodes_match_reference(
    num_splits: int | None, num_heads: int, num_kv_heads: int
) -> None:
    """Requests of up to four tokens by the decode kernel, each token seeing the context up to
    its own position, in one split or several (with 8, the last split of the 65-token context
    lies past its first two queries); the prompt by the prefill kernel."""
    case = make_case(VERIFYING, num_heads, num_kv_heads, 64, torch.float32, seed=num_heads)
    expected = paged_attention_reference(**case)
    out = split_mixed(case, max_queries=4, num_splits=num_splits)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_the_decode_kernel_writes_only_requests_within_max_queries() -> None:
    case = make_case(VERIFYING, 8, 2, 64, torch.float32, seed=5)
    expected = paged_attention_reference(**case)
    args = [case[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
    sentinel = torch.full_like(case["query"], 7.0)
    out = paged_decode_attention(
        *args, case["scale"], query_start_loc=case["query_start_loc"], out=sentinel.clone(),
        max_queries=3,
    )  # fmt: skip
    loc = case["query_start_loc"].tolist()
    rows = [t for s, e in itertools.pairwise(loc) if 1 <= e - s <= 3 for t in range(s, e)]
    written = (out != sentinel).any(dim=(1, 2)).nonzero().flatten()
    assert written.tolist() == rows
    torch.testing.assert_close(out[rows], expected[rows], atol=1e-4, rtol=1e-4)


def test_rejects_inconsistent_metadata() -> None:
    case = make_case([(4, 4), (2, 6)], 2, 2, 64, torch.float32, seed=0)
    case["query_start_loc"] = case["query_start_loc"][:-1]
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(**case)
    with pytest.raises(ValueError, match="block_n"):
        PrefillTiles(block_m=16, block_n=8, num_warps=4, num_stages=2)


FLOAT_INPUTS = ("query", "key_cache", "value_cache")


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected).norm() / expected.norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_shapes(dtype: torch.dtype) -> None:
    requests = [(512, 512), (2000, 2000), (1024, 1500), (777, 1800), (1, 3000), (1, 17)]
    case = make_case(requests, 32, 8, 128, dtype, seed=5)
    upcast = {k: v.float() if k in FLOAT_INPUTS else v for k, v in case.items()}
    expected = paged_attention_reference(**upcast)  # float32 on the same rounded inputs
    out = paged_prefill_attention(**case)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert relative_error(out, expected) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_shapes_decodes_split_off() -> None:
    """A serving step: 32 decodes of up to 4k context riding along with a 200-token prompt."""
    generator = torch.Generator().manual_seed(8)
    contexts = torch.randint(1, 4097, (32,), generator=generator).tolist()
    case = make_case([(1, n) for n in contexts] + [(200, 200)], 32, 8, 128, torch.bfloat16, 6)
    upcast = {k: v.float() if k in FLOAT_INPUTS else v for k, v in case.items()}
    expected = paged_attention_reference(**upcast)
    out = split_mixed(case)
    assert torch.isfinite(out).all() and relative_error(out, expected) < 1e-2


@pytest.mark.parametrize("window", [None, 7])
def test_attention_sinks_match_the_reference(window: int | None) -> None:
    """gpt-oss's sinks: a logit a head in the softmax's denominator, some far above the scores
    (most of the weight to the sink) and some far below (none), with and without a window."""
    case = make_case(BATCHES["mixed"] + BATCHES["chunked"], 6, 2, 64, torch.float32, seed=5)
    sinks = torch.tensor([0.0, 3.0, -2.0, 20.0, -30.0, 1.0], device=DEVICE)
    expected = paged_attention_reference(**case, window=window, sinks=sinks)
    assert not torch.allclose(expected, paged_attention_reference(**case, window=window))
    out = paged_prefill_attention(**case, tiles=PrefillTiles(16, 16, 4, 2), window=window,
                                  sinks=sinks)  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 7])
def test_soft_capped_scores_match_the_reference(window: int | None) -> None:
    """Gemma 2's soft-capping, cap * tanh(score / cap), with a cap low enough to bend the
    scores (the query's scale 0.125 on scores of a few units)."""
    case = make_case(BATCHES["mixed"] + BATCHES["chunked"], 6, 2, 64, torch.float32, seed=6)
    expected = paged_attention_reference(**case, window=window, softcap=0.5)
    assert not torch.allclose(expected, paged_attention_reference(**case, window=window))
    out = paged_prefill_attention(**case, tiles=PrefillTiles(16, 16, 4, 2), window=window,
                                  softcap=0.5)  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
