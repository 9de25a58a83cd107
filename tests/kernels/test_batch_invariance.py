"""`--batch-invariant` (kernels/invariance.py): with it, a row of a decode step of up to 16
rows gets the same bits as it would in a step of its own, in the skinny linear layer and in the
split-KV decode attention, where a request verifying k drafts computes each of its k + 1 query
tokens as a one-token decode at that position would.

Under the Triton interpreter on the CPU; on the GPU the same tests run at the device's dtypes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")

from kernels import triton_norm
from kernels.invariance import set_batch_invariant
from kernels.triton_decode_attention import paged_decode_attention
from kernels.triton_linear import skinny_linear
from tests.kernels.paged_cache import scattered_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


@pytest.fixture
def invariant() -> Iterator[None]:
    set_batch_invariant(True)
    yield
    set_batch_invariant(False)


def _rows_alone(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.cat([skinny_linear(x[i : i + 1], weight) for i in range(x.shape[0])])


@pytest.mark.parametrize("k", [576, 2048])  # a small model's K (its own tiles), and a wide one
def test_a_linear_rows_sums_do_not_depend_on_the_other_rows(invariant: None, k: int) -> None:
    generator = torch.Generator().manual_seed(k)
    x = torch.randn(9, k, generator=generator).to(DEVICE, DTYPE)
    weight = torch.randn(96, k, generator=generator).to(DEVICE, DTYPE) / k**0.5
    together = skinny_linear(x, weight)
    assert torch.equal(_rows_alone(x, weight), together)
    assert torch.equal(skinny_linear(x[:16].repeat(2, 1)[:16], weight)[:9], together)


def test_without_it_one_row_sums_in_another_order() -> None:
    """Why the flag exists: one row's GEMV (multiply-adds) and the tensor-core tile of 2-16
    rows round differently."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(9, 2048, generator=generator).to(DEVICE, DTYPE)
    weight = torch.randn(96, 2048, generator=generator).to(DEVICE, DTYPE) / 2048**0.5
    assert not torch.equal(_rows_alone(x, weight), skinny_linear(x, weight))


@pytest.mark.parametrize("context", [200, 254, 509, 700])  # queries on both sides of a split
def test_a_verifying_rows_queries_are_the_decodes_at_their_positions(
    invariant: None, context: int
) -> None:
    queries, num_heads, num_kv_heads, head_dim = 5, 8, 2, 64
    generator = torch.Generator().manual_seed(context)
    key_cache, value_cache, tables = scattered_cache(
        [context], num_kv_heads, head_dim, DTYPE, generator
    )
    key_cache, value_cache, tables = key_cache.to(DEVICE), value_cache.to(DEVICE), tables.to(DEVICE)
    query = torch.randn(queries, num_heads, head_dim, generator=generator).to(DEVICE, DTYPE)
    verified = paged_decode_attention(
        query, key_cache, value_cache, tables, _lens([context]), 0.125,
        query_start_loc=_lens([0, queries]), max_queries=queries,
    )  # fmt: skip
    for j in range(queries):  # query j sees the context up to its own position
        own = context - queries + j + 1
        alone = paged_decode_attention(
            query[j : j + 1], key_cache, value_cache, tables, _lens([own]), 0.125
        )
        assert torch.equal(alone[0], verified[j]), f"query {j} at {own} tokens"


def _lens(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("hidden", [576, 128])  # a small model's rows; Qwen3's per-head norm
def test_a_norms_rows_do_not_depend_on_the_other_rows(invariant: None, hidden: int) -> None:
    generator = torch.Generator().manual_seed(hidden)
    x = torch.randn(9, hidden, generator=generator).to(DEVICE, DTYPE)
    residual = torch.randn(9, hidden, generator=generator).to(DEVICE, DTYPE)
    weight = torch.rand(hidden, generator=generator).to(DEVICE, DTYPE)
    together = triton_norm.rms_norm(x, weight, 1e-6)
    alone = torch.cat([triton_norm.rms_norm(x[i : i + 1], weight, 1e-6) for i in range(9)])
    assert torch.equal(alone, together)
    normed, summed = triton_norm.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    for i in range(9):
        one = (x[i : i + 1].clone(), residual[i : i + 1].clone())
        row = triton_norm.fused_add_rms_norm(*one, weight, 1e-6)
        assert torch.equal(row[0], normed[i : i + 1]) and torch.equal(row[1], summed[i : i + 1])
