"""Decode inputs gathered from the last sampled ids: Triton against the torch reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.inputs import gather_sampled_inputs_reference
from kernels.triton_inputs import gather_sampled_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_tokens", [1, 7, 1500])
def test_gather_takes_sampled_ids_where_a_row_is_named(num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    input_ids = torch.randint(0, 1000, (num_tokens,), generator=gen, dtype=torch.int32)
    sampled_ids = torch.randint(1000, 2000, (64,), generator=gen)  # [max_reqs] int64
    source_rows = torch.randint(-1, 64, (num_tokens,), generator=gen, dtype=torch.int32)
    source_rows[0] = -1  # at least one token keeps its id
    expected = input_ids.clone()
    gather_sampled_inputs_reference(expected, source_rows, sampled_ids)
    named = source_rows >= 0
    assert torch.equal(expected[named], sampled_ids[source_rows[named].long()].int())
    assert torch.equal(expected[~named], input_ids[~named])

    ids = input_ids.to(DEVICE)
    gather_sampled_inputs(ids, source_rows.to(DEVICE), sampled_ids.to(DEVICE))
    assert torch.equal(ids.cpu(), expected)


def test_gather_rejects_mismatched_shapes() -> None:
    ids = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="source_rows"):
        gather_sampled_inputs(ids, torch.zeros(3, dtype=torch.int32, device=DEVICE), ids.long())
