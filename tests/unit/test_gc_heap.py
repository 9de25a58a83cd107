"""shared/gc_heap.py: the heap frozen for a run and thawed after it, whatever ends the run;
a started process's garbage collected before the freeze, and an earlier start's at the next;
collections counted and timed while watched, and only then."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import pytest

from shared.gc_heap import collections_watched, freeze_startup_heap, heap_frozen


@pytest.fixture(autouse=True)
def thawed_and_no_automatic_collection() -> Iterator[None]:
    """Each test starts from a thawed heap, and no automatic collection (which Python 3.12
    runs at any eval-breaker check) frees a test's garbage before the test looks."""
    gc.unfreeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


class Cycle:
    """Garbage that only a collection finds."""

    def __init__(self) -> None:
        self.me = self


def test_a_run_freezes_the_heap_and_thaws_it_even_on_error() -> None:
    with heap_frozen():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), heap_frozen():
        raise RuntimeError("a step failed")
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_already_stays_frozen_after_a_run() -> None:
    """A run within a run, or an application that froze its own heap: its owner thaws it."""
    with contextlib.ExitStack() as outer:
        outer.enter_context(heap_frozen())
        with heap_frozen():
            pass
        # still frozen (the count itself moves: a frozen object freed leaves the generation)
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_a_started_process_collects_its_garbage_before_freezing() -> None:
    garbage = weakref.ref(Cycle())  # alive until a collection finds it, or forever if frozen
    assert garbage() is not None
    freeze_startup_heap()
    assert gc.get_freeze_count() > 0
    assert garbage() is None


def test_a_second_start_collects_what_the_first_froze() -> None:
    """A scheduler's engine replaced after its executor came back: the old one's cycles,
    frozen at the first start, are collected at the second."""
    engine = Cycle()
    old = weakref.ref(engine)
    freeze_startup_heap()
    del engine
    assert old() is not None  # frozen: no collection sees it
    freeze_startup_heap()
    assert old() is None


def test_collections_are_counted_by_generation_while_watched_and_only_then() -> None:
    gc.collect()  # before the watch: not counted
    with collections_watched() as watched:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    gc.collect()  # after it: not counted either
    assert watched.count == [1, 0, 2]
    report = watched.report()
    assert report["count_by_generation"] == [1, 0, 2]
    assert report["longest_ms"] >= max(report["ms_by_generation"]) / 2 > 0
