"""What the stall watch of an executor rank sees: the steps it launched and not finished."""

from __future__ import annotations

import logging
import threading
from collections import deque

from shared.stall_watch import StallWatch

logger = logging.getLogger(__name__)


class StepWatch:
    """The steps launched and not answered yet, oldest first, as the stall watch sees them:
    the oldest must end within --engine-stall-timeout."""

    def __init__(self, watch: StallWatch, hang_step: int | None = None) -> None:
        self.watch, self.hang_step = watch, hang_step
        self.launched: deque[int] = deque()

    def launching(self, step: int) -> None:
        self.launched.append(step)
        if len(self.launched) == 1:
            self.watch.working(f"step {step}")
        if step == self.hang_step:  # testing only (--fault-hang-step): heartbeats go on
            logger.warning("--fault-hang-step: step %d hangs", step)
            threading.Event().wait()

    def answered(self, step: int) -> None:
        if self.launched and self.launched[0] == step:
            self.launched.popleft()
        if self.launched:
            self.watch.working(f"step {self.launched[0]}")
        else:
            self.watch.idle()

    def reset(self) -> None:
        self.launched.clear()
        self.watch.idle()
