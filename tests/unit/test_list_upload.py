"""The proposer's upload: the lists come back as they went, each on 16 bytes (Triton compiles
a new kernel variant for a pointer it has not seen aligned so)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.executor.runner.list_upload import ListUpload

LISTS = st.lists(st.lists(st.integers(-(2**40), 2**40), max_size=9), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(rounds=st.lists(LISTS, min_size=1, max_size=4))
def test_lists_come_back_whole_and_aligned(rounds: list[list[list[int]]]) -> None:
    upload = ListUpload(ListUpload.room(*[9] * 6), torch.device("cpu"))
    for lists in rounds:
        parts = upload.send(*lists)
        assert [part.tolist() for part in parts] == lists
        assert all(part.dtype == torch.int64 and part.is_contiguous() for part in parts)
        assert all(part.data_ptr() % 16 == 0 for part in parts)


def test_room_holds_the_padding() -> None:
    sizes = (3, 1, 0, 5)
    upload = ListUpload(ListUpload.room(*sizes), torch.device("cpu"))
    parts = upload.send(*[list(range(size)) for size in sizes])
    assert [part.numel() for part in parts] == list(sizes)
