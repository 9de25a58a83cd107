"""The embedding lookup of a rank holding some of the vocabulary (kernels/triton_embedding.py)
against its torch reference: on the CPU under the Triton interpreter, on a GPU as is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kernels.embedding import embedding_rows_reference
from kernels.triton_embedding import embedding_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("first_id", "hidden"), [(0, 64), (40, 96), (80, 2056)])
def test_rows_of_held_ids_and_zeros_for_the_rest(
    first_id: int, hidden: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(first_id + hidden)
    weight = torch.randn(40, hidden, generator=gen).to(DEVICE, dtype)  # ids first_id .. + 39
    ids = torch.tensor([0, 39, 40, 79, 80, 119, 5, 45, 85], device=DEVICE)
    got = embedding_rows(ids, weight, first_id)
    expected = embedding_rows_reference(ids, weight, first_id)
    assert torch.equal(got, expected)
    held = (ids >= first_id) & (ids < first_id + 40)
    assert torch.equal(got[held], weight[ids[held] - first_id])
    assert not got[~held].any()


def test_two_ranks_rows_add_up_to_the_whole_embedding() -> None:
    gen = torch.Generator().manual_seed(2)
    whole = torch.randn(64, 48, generator=gen).to(DEVICE)
    ids = torch.randint(0, 64, (17,), generator=gen).to(DEVICE, torch.int32)
    parts = [embedding_rows(ids, whole[r * 32 : (r + 1) * 32], r * 32) for r in range(2)]
    assert torch.equal(parts[0] + parts[1], F.embedding(ids.long(), whole))


def test_strided_ids() -> None:
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ids = torch.tensor([[1, 9], [5, 9], [7, 9]], device=DEVICE)[:, 0]  # every other value
    assert torch.equal(embedding_rows(ids, weight, 0), weight[[1, 5, 7]])


def test_no_tokens_and_bad_shapes() -> None:
    weight = torch.zeros(4, 8, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert embedding_rows(none, weight, 0).shape == (0, 8)
    with pytest.raises(ValueError, match="ids"):
        embedding_rows(torch.zeros(2, 1, dtype=torch.int64, device=DEVICE), weight, 0)
