"""Row-wise argmax in two passes against torch.argmax, ties and chunk edges included."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.argmax import argmax_reference
from kernels.triton_argmax import argmax

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 5), (3, 4096), (4, 4097), (2, 9000)])
def test_argmax_matches_torch(rows: int, vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    # Ties across chunks and inside one: the first index must win, as in torch.argmax.
    top = logits.max() + 1
    logits[0, vocab // 2 :: 1000] = top
    logits[-1, -1] = top + 1
    expected = argmax_reference(logits)
    assert torch.equal(argmax(logits.to(DEVICE)).cpu(), expected)


def test_argmax_reads_a_column_slice_of_wider_logits() -> None:
    logits = torch.randn(3, 300)
    logits[:, 250:] = 100.0  # padding columns past the vocabulary must not win
    assert torch.equal(argmax(logits.to(DEVICE)[:, :250]).cpu(), logits[:, :250].argmax(-1))


def test_argmax_adds_offsets_and_writes_a_strided_out() -> None:
    """An EAGLE-3 head's draft: the index plus its offset (the draft vocabulary's map into the
    target's), written into one row of the drafts table [k, R] (a column stride of 1 there, a
    row of another table here)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5000, generator=gen)
    offsets = torch.randint(0, 1000, (5000,), generator=gen)
    table = torch.full((3, 2), -1, dtype=torch.int64)
    expected = argmax_reference(logits, offsets, table[:, 1].clone())
    assert torch.equal(expected, logits.argmax(-1) + offsets[logits.argmax(-1)])
    table = table.to(DEVICE)
    got = argmax(logits.to(DEVICE), offsets.to(DEVICE), table[:, 1])
    assert got.data_ptr() == table[:, 1].data_ptr()
    assert torch.equal(table[:, 1].cpu(), expected) and (table[:, 0] == -1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8, 256])
def test_argmax_at_llama3_vocabulary(rows: int) -> None:
    logits = torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16) * 4
    assert torch.equal(argmax(logits), argmax_reference(logits))
