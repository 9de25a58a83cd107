"""The scheduler's record of which tokenizer worker each unfinished request came from counts
each worker's requests exactly, whatever order they are added and ended in."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.request_owners import RequestOwners


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.sampled_from([b"a", b"b"]))))
def test_each_workers_count_is_its_unfinished_requests(
    steps: list[tuple[bool, int, bytes]],
) -> None:
    owners, expected = RequestOwners(), {}
    for add, request, worker in steps:
        rid = f"r{request}"
        if add:
            owners.add(rid, worker)
            expected[rid] = worker
        else:
            assert owners.pop(rid) == expected.pop(rid, None)
        assert owners.counts == Counter(expected.values())
        assert set(owners) == set(expected) and len(owners) == len(expected)
