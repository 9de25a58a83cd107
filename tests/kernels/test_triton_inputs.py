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


def test_draft_pass_inputs_match_the_reference_and_the_rules() -> None:
    """An EAGLE-3 draft pass's slots, context lengths and rotary positions: a row that does
    not draft, a row whose position falls in a block it does not hold yet, and a row at
    max_model_len write no KV and attend to one token; the others write at their slot."""
    from kernels.inputs import draft_pass_inputs_reference
    from kernels.triton_inputs import draft_pass_inputs

    size, max_len, step = 16, 100, 2
    last = torch.tensor([0, 13, 14, 30, 98, 40, 5], dtype=torch.int32)
    drafting = torch.tensor([True, True, True, True, True, False, True])
    row_blocks = torch.tensor([1, 1, 2, 2, 7, 3, 1])
    tables = torch.arange(9 * 8, dtype=torch.int32).view(9, 8)  # more rows than the pass's
    outs = [torch.full((7,), 7, dtype=torch.int32) for _ in range(3)]
    draft_pass_inputs_reference(last, step, drafting, row_blocks, tables, size, max_len, *outs)
    # positions 2, 15, 16, 32, 100, 42, 7; row r's block at column c is 8 r + c
    assert outs[0].tolist() == [2, 8 * 16 + 15, 17 * 16, -1, -1, -1, 48 * 16 + 7]
    assert outs[1].tolist() == [3, 16, 17, 1, 1, 1, 8]
    assert outs[2].tolist() == [2, 15, 16, 32, 99, 42, 7]

    device_outs = [torch.zeros(7, dtype=torch.int32, device=DEVICE) for _ in range(3)]
    device_last, device_drafting, device_blocks = (
        t.to(DEVICE) for t in (last, drafting, row_blocks)
    )
    draft_pass_inputs(
        device_last, step, device_drafting, device_blocks, tables.to(DEVICE), size, max_len,
        *device_outs,
    )  # fmt: skip
    for got, want in zip(device_outs, outs, strict=True):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("verify", [True, False])
def test_catch_up_rows_match_the_reference_and_the_rules(verify: bool) -> None:
    """A step's catch-up rows: each verified row accepts its leading drafts equal to the
    samples after its first (-1: no draft, equal to no sample), and drafts at base + accepted;
    a row with base -1 (no drafts) and the padding rows past the verified ones draft nowhere;
    without samples nothing is accepted."""
    from kernels.inputs import catch_up_rows_reference
    from kernels.triton_inputs import catch_up_rows

    base = torch.tensor([3, 7, -1, 10, 0, -1])  # two padding rows past the four verified
    blocks = torch.tensor([1, 2, 3, 4, 5, 6])
    first_sample = torch.tensor([0, 3, 5, 6])
    drafts = torch.tensor([[11, 12, 13], [21, 99, 23], [31, 32, 33], [-1, -1, -1]])
    # samples: row 0 at 0-3 (all three drafts match), row 1 at 3-6 (one), row 3 at 6 (clamped)
    sampled = torch.tensor([11, 12, 13, 21, 22, 23, 40]) if verify else None
    positions = torch.arange(100, 120)

    def run(fn, device: str) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
        outs = [torch.full((6,), 5, dtype=torch.int64, device=device)]
        outs += [torch.full((4,), 5, dtype=torch.int64, device=device)]
        outs += [torch.ones(6, dtype=torch.bool, device=device)]
        outs += [torch.full((6,), 5, dtype=torch.int64, device=device) for _ in range(2)]
        args = [t.to(device) for t in (base, blocks, first_sample, drafts)]
        samples = None if sampled is None else sampled.to(device)
        fn(*args, samples, positions.to(device), *outs)
        return [out.cpu() for out in outs]

    want = run(catch_up_rows_reference, "cpu")
    row_blocks, accepted, drafting, at, last = want
    draft_at = torch.where(drafting, at, -1)  # the drafting position's index, -1: none
    assert row_blocks.tolist() == blocks.tolist()
    assert accepted.tolist() == ([3, 1, 0, 0] if verify else [0, 0, 0, 0])
    assert draft_at.tolist() == ([6, 8, -1, 10, 0, -1] if verify else [3, 7, -1, 10, 0, -1])
    assert drafting.tolist() == [d >= 0 for d in draft_at.tolist()]
    assert at.tolist() == [max(d, 0) for d in draft_at.tolist()]
    assert last.tolist() == [100 + a for a in at.tolist()]
    for got, expected in zip(run(catch_up_rows, DEVICE), want, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("num_tokens", [1, 4, 2500])  # 2500: the copy in three blocks
@pytest.mark.parametrize("with_samples", [True, False])
def test_next_token_ids_match_the_reference(num_tokens: int, with_samples: bool) -> None:
    """The token after each position: the next input id, or the sample where the position
    sampled (the last position's only where it sampled); past T - 1 nothing is written."""
    from kernels.inputs import next_token_ids_reference
    from kernels.triton_inputs import next_token_ids

    gen = torch.Generator().manual_seed(num_tokens)
    input_ids = torch.randint(0, 1000, (num_tokens + 3,), generator=gen, dtype=torch.int32)
    rows = sorted({num_tokens - 1, *torch.randint(0, num_tokens, (5,), generator=gen).tolist()})
    sample_rows = torch.tensor(rows, dtype=torch.int32)
    sampled = 5000 + torch.arange(len(rows)) if with_samples else None
    want = torch.full((num_tokens + 3,), -7, dtype=torch.int32)
    next_token_ids_reference(input_ids, sample_rows, sampled, want, num_tokens)
    assert want[num_tokens:].eq(-7).all()
    if with_samples:
        assert want[num_tokens - 1] == 5000 + len(rows) - 1
    got = torch.full((num_tokens + 3,), -7, dtype=torch.int32, device=DEVICE)
    samples = None if sampled is None else sampled.to(DEVICE)
    next_token_ids(input_ids.to(DEVICE), sample_rows.to(DEVICE), samples, got, num_tokens)
    assert torch.equal(got.cpu(), want)
