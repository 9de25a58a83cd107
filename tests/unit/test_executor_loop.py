"""The executor loop's ordering promise, with a scripted device in place of a GPU.

The scheduler holds one plan at a time: the plan after step k must be launched (DeviceReady,
then LaunchStep) before step k's answer lets the scheduler send the one after it. On a GPU
the loop looks at the device twice (has the forward pass ended? has the step ended?), and
the device may move on between the two looks; the answer must still come second.
"""

from __future__ import annotations

import threading
from collections import deque

import pytest
import zmq

from services.executor.process import serve_plans
from services.executor.runner.step_watch import StepWatch
from shared.ipc import Decoder, encode
from shared.protocol import (
    DeviceReady,
    LaunchStep,
    ModelRunnerOutput,
    SchedulerOutput,
    ToExecutor,
    ToScheduler,
)
from shared.stall_watch import StallWatch

LAST_STEP = 99


class EndOfTest(Exception):
    """Ends the executor loop: the device raises it when plan LAST_STEP comes."""


class DeviceThatMovesOn:
    """Each launched step is seen unfinished at the first look at its forward pass, and
    entirely finished at every later look: the worst case of a thread descheduled between
    the loop's two looks."""

    def __init__(self) -> None:
        self.prepared: int | None = None
        self.in_flight: deque[int] = deque()
        self.looks = 0

    def prepare(self, plan: SchedulerOutput) -> None:
        if plan.step == LAST_STEP:
            raise EndOfTest
        self.prepared = plan.step

    def amend(self, addendum: SchedulerOutput) -> None:
        raise AssertionError("no addenda here")

    def launch(self, step: int) -> None:
        assert self.prepared == step
        self.prepared = None
        self.in_flight.append(step)
        self.looks = 0

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def launch_point_passed(self) -> bool:
        if not self.in_flight:
            return True
        self.looks += 1
        return self.looks > 1

    def oldest_finished(self) -> bool:
        return bool(self.in_flight) and self.looks >= 1

    def collect(self) -> ModelRunnerOutput:
        return ModelRunnerOutput(step=self.in_flight.popleft(), sampled={})


def plan(step: int) -> SchedulerOutput:
    return SchedulerOutput(
        step=step,
        new_requests=[],
        cached_requests=[],
        num_scheduled_tokens={},
        finished_request_ids=[],
    )


@pytest.fixture
def sockets():
    context = zmq.Context()
    scheduler = context.socket(zmq.ROUTER)
    scheduler.bind("inproc://executor-loop")
    executor = context.socket(zmq.DEALER)
    executor.connect("inproc://executor-loop")
    yield scheduler, executor
    scheduler.close(linger=0)
    executor.close(linger=0)
    context.term()


def test_the_next_launch_is_asked_for_before_a_step_is_answered(sockets) -> None:
    scheduler, executor = sockets
    device = DeviceThatMovesOn()
    ended: list[BaseException] = []

    def run_loop() -> None:
        try:
            steps = StepWatch(StallWatch(60))
            serve_plans(device, executor, Decoder(ToExecutor, "executor-0"), "m", steps)  # type: ignore[arg-type]
        except EndOfTest as exc:
            ended.append(exc)

    loop = threading.Thread(target=run_loop, daemon=True)
    loop.start()
    decoder = Decoder(ToScheduler, "scheduler")

    def receive() -> tuple[bytes, object]:
        assert scheduler.poll(5000), "the executor loop said nothing"
        identity, frame = scheduler.recv_multipart()
        return identity, decoder.decode(frame)

    identity, first = receive()
    assert isinstance(first, DeviceReady)  # idle: launch whatever comes
    received = []
    for step in (1, 2, 3):
        scheduler.send_multipart([identity, encode(plan(step))])
        scheduler.send_multipart([identity, encode(LaunchStep(step))])
        received += [receive()[1], receive()[1]]
    assert received == [
        DeviceReady(),
        ModelRunnerOutput(step=1, sampled={}),
        DeviceReady(),
        ModelRunnerOutput(step=2, sampled={}),
        DeviceReady(),
        ModelRunnerOutput(step=3, sampled={}),
    ]
    scheduler.send_multipart([identity, b"not a message"])  # dropped: the loop goes on
    scheduler.send_multipart([identity, encode(plan(LAST_STEP))])  # ends the loop
    loop.join(5)
    assert not loop.is_alive() and ended
