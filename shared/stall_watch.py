"""Catching a process whose main loop is stuck while its threads still run.

A heartbeat thread keeps beating when the main thread hangs (a device call that never returns,
a deadlock), so a stuck engine looks alive. The main loop marks each unit of work it starts and
ends (`working`, `idle`); the heartbeat thread asks `stalled()` on every beat and reports it, and
once a unit has run past the timeout the process dumps every thread's stack and exits with
STALL_EXIT_CODE, so that its supervisor (`kvflow serve`, compose, Kubernetes) restarts it.

    main:       working("step 7") ........ (hangs) ..........................
    heartbeat:  beat  beat  beat ... beat(stalled="step 7 ...")  ...  exit(STALL_EXIT_CODE)
                                     |<- timeout ->|            |<- STALL_EXIT_GRACE_S ->|

Slow is not stuck. Where the work computes on the CPU in the watched thread (the executor on a
CPU device), the watch also reads that thread's CPU time (`cpu_clock`): a thread that keeps
computing, however slowly (a machine starved of CPU, or of memory), is making progress; a
stuck one (a deadlock, a call that never returns) uses none. On a GPU the host thread may spin
while it waits for a device that hangs, so there only the wall clock counts.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)
STALL_EXIT_CODE = 70  # EX_SOFTWARE: the supervisor's log shows why the process went
STALL_EXIT_GRACE_S = 1.5  # after the first stalled beat: time for frontends to hear it
# CPU time the watched thread must use, since the last progress, to count as computing: a
# blocked thread's wakeups cost microseconds, a starved one that computes gets far more.
CPU_PROGRESS_S = 0.1


def thread_cpu_clock(thread: threading.Thread | None = None) -> Callable[[], float] | None:
    """The CPU time (seconds) `thread` (default: the main thread) has used, as a clock another
    thread can read; None where the platform has no such clock."""
    ident = (thread or threading.main_thread()).ident
    try:
        clock_id = time.pthread_getcpuclockid(ident or 0)
    except (AttributeError, OSError):
        return None
    return lambda: time.clock_gettime(clock_id)


class StallWatch:
    def __init__(
        self,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] | None = None,
    ) -> None:
        self.timeout = timeout
        self._now = clock
        # The working thread's CPU time, where computing counts as progress; None: it does not
        self.cpu_clock = cpu_clock
        self._lock = threading.Lock()
        self._work: str | None = None  # what the main loop is doing, while it does it
        self._since = 0.0  # when it last made progress
        self._cpu_at = 0.0  # the working thread's CPU time then
        self._reported_at: float | None = None

    def working(self, work: str) -> None:
        """The main loop made progress and now does `work` (e.g. "step 7"), which should end
        (or make progress again) within the timeout."""
        with self._lock:
            self._work, self._since, self._reported_at = work, self._now(), None
            self._cpu_at = self.cpu_clock() if self.cpu_clock is not None else 0.0

    def idle(self) -> None:
        """Nothing to do: waiting for work is not a stall."""
        with self._lock:
            self._work, self._reported_at = None, None

    def stalled(self) -> str | None:
        """Why the main loop counts as stuck, or None."""
        with self._lock:
            if self._work is None:
                return None
            now = self._now()
            if self.cpu_clock is not None:
                used = self.cpu_clock()
                if used - self._cpu_at >= CPU_PROGRESS_S:  # computing: slow, not stuck
                    self._since, self._cpu_at, self._reported_at = now, used, None
            elapsed = now - self._since
            if elapsed <= self.timeout:
                return None
            idle = "" if self.cpu_clock is None else ", computing nothing"
            return (
                f"{self._work} has made no progress for {elapsed:.0f} s{idle} "
                f"(--engine-stall-timeout {self.timeout:g})"
            )

    def exit_if_stalled(self, component: str) -> str | None:
        """Called on every heartbeat: the stall to report, and the process ends once it has
        been reported for STALL_EXIT_GRACE_S."""
        reason = self.stalled()
        if reason is None:
            return None
        now = self._now()
        if self._reported_at is None:
            self._reported_at = now
            logger.error("%s is stalled: %s", component, reason)
        elif now - self._reported_at >= STALL_EXIT_GRACE_S:
            logger.critical("%s is stalled: %s; exiting so that it is restarted", component, reason)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            logging.shutdown()
            os._exit(STALL_EXIT_CODE)  # the main thread is stuck: nothing else can end it
        return reason
