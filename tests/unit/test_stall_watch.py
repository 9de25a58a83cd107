"""The stall watch: when a unit of work counts as stuck, and that progress or idleness is not.
(The exit it ends in is exercised end to end in tests/e2e/test_reliability.py.)"""

from __future__ import annotations

import threading
import time

from services.executor.runner.step_watch import StepWatch
from shared.stall_watch import StallWatch, thread_cpu_clock


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_work_past_the_timeout_is_a_stall_that_names_it() -> None:
    clock = Clock()
    watch = StallWatch(10.0, clock)
    watch.working("step 7")
    clock.now = 10.0
    assert watch.stalled() is None  # exactly the timeout: still fine
    clock.now = 12.0
    assert watch.stalled() == ("step 7 has made no progress for 12 s (--engine-stall-timeout 10)")


def test_progress_restarts_the_clock_and_idleness_is_no_stall() -> None:
    clock = Clock()
    watch = StallWatch(10.0, clock)
    watch.working("a turn")
    clock.now = 9.0
    watch.working("a turn")
    clock.now = 18.0
    assert watch.stalled() is None
    watch.idle()
    clock.now = 1000.0
    assert watch.stalled() is None


def test_the_executor_watches_its_oldest_launched_step() -> None:
    clock = Clock()
    watch = StallWatch(5.0, clock)
    steps = StepWatch(watch)
    steps.launching(1)
    clock.now = 4.0
    steps.launching(2)  # pipelined: step 1 is still the one that must end
    clock.now = 6.0
    assert watch.stalled() is not None and watch.stalled().startswith("step 1 ")
    steps.answered(1)  # step 2's clock starts when it becomes the oldest
    assert watch.stalled() is None
    clock.now = 11.5
    assert watch.stalled().startswith("step 2 ")
    steps.answered(2)
    assert watch.stalled() is None


def test_on_a_cpu_device_a_thread_still_computing_is_slow_not_stuck() -> None:
    """A step on a starved CPU: its thread keeps using CPU time, a little at a time, for ten
    times the timeout; then it blocks (a deadlock), and the timeout counts from its last
    computing."""
    clock, cpu = Clock(), Clock()
    watch = StallWatch(10.0, clock, cpu_clock=cpu)
    watch.working("step 7")
    for _ in range(100):  # 100 s, 0.15 s of CPU every second
        clock.now += 1.0
        cpu.now += 0.15
        assert watch.stalled() is None
    blocked_at = clock.now
    clock.now = blocked_at + 10.0
    assert watch.stalled() is None
    clock.now = blocked_at + 12.0
    assert watch.stalled() == (
        "step 7 has made no progress for 12 s, computing nothing (--engine-stall-timeout 10)"
    )


def test_a_blocked_thread_s_wakeups_are_not_progress() -> None:
    clock, cpu = Clock(), Clock()
    watch = StallWatch(10.0, clock, cpu_clock=cpu)
    watch.working("step 7")
    for _ in range(11):
        clock.now += 1.0
        cpu.now += 0.001  # woken now and then, computing nothing
        watch.stalled()
    assert watch.stalled() is not None


def test_the_main_thread_s_cpu_clock_reads_its_own_time_from_another_thread() -> None:
    clock = thread_cpu_clock()
    assert clock is not None
    start, seen = clock(), []
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:  # the main thread computes
        pass
    reader = threading.Thread(target=lambda: seen.append(clock()))
    reader.start()
    reader.join()
    assert seen[0] - start >= 0.04
