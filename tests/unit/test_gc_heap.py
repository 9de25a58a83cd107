"""shared/gc_heap.py: the heap frozen for a run and thawed after it, whatever ends the run."""

from __future__ import annotations

import gc
import weakref

import pytest

from shared.gc_heap import freeze_startup_heap, heap_frozen


def test_a_run_freezes_the_heap_and_thaws_it_even_on_error() -> None:
    before = gc.get_freeze_count()
    with heap_frozen():
        assert gc.get_freeze_count() > before
    assert gc.get_freeze_count() == before
    with pytest.raises(RuntimeError), heap_frozen():
        raise RuntimeError("a step failed")
    assert gc.get_freeze_count() == before


def test_a_started_process_collects_its_garbage_before_freezing() -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    garbage = weakref.ref(Cycle())  # alive until a collection finds it, or forever if frozen
    assert garbage() is not None
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert garbage() is None
    finally:
        gc.unfreeze()


def test_a_second_start_collects_what_the_first_froze() -> None:
    """A scheduler's engine replaced after its executor came back: the old one's cycles,
    frozen at the first start, are collected at the second."""

    class Engine:
        def __init__(self) -> None:
            self.me = self

    engine = Engine()
    old = weakref.ref(engine)
    try:
        freeze_startup_heap()
        del engine
        assert old() is not None  # frozen: no collection sees it
        freeze_startup_heap()
        assert old() is None
    finally:
        gc.unfreeze()
