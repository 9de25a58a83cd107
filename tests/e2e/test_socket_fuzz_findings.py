"""What the fuzzing of tests/e2e/test_socket_fuzz.py found, pinned: each test against a process
of its own or in-process. (Two stay there: the executor's inconsistent plans, against that
module's executor, and its last test, which ends its `kvflow serve` where the bug is back.)
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from services.scheduler.scheduler import Scheduler
from services.scheduler.scheduler_config import SchedulerConfig
from shared.ipc import Decoder, connect_dealer
from shared.protocol import (
    PROTOCOL_VERSION,
    ComponentDown,
    EngineRequest,
    ExecutorReady,
    ExecutorVersion,
    FrontendToTokenizer,
    Heartbeat,
    ModelRunnerOutput,
    ParameterError,
    SamplingParams,
    SchedulerOutput,
    SchedulerToTokenizer,
    ToExecutor,
    ToFrontend,
    ToScheduler,
)
from tests.e2e.fuzz_frames import ENCODE, INVALID_UTF8_ID, INVALID_UTF8_TAG, deeply_nested
from tests.e2e.fuzz_processes import (
    DEADLINE_S,
    PINGS,
    dealer,
    outputs_of,
    spawn,
    status,
    stop,
)
from tests.e2e.fuzz_processes import context as context  # fixtures: `as` marks them used
from tests.e2e.fuzz_processes import folder as folder
from tests.e2e.server import free_port

PROBE_DEADLINE_S = 5.0  # shorter than DEADLINE_S: probes where a missing answer is the bug
LONE = itertools.count()


@pytest.fixture
def lone_frontend(
    folder: Path, context: zmq.Context[zmq.Socket[bytes]]
) -> Iterator[tuple[str, str]]:
    """A frontend started alone, with a 1 s component timeout: (its URL, its ROUTER)."""
    address, port = f"ipc://{folder}/lone-frontend-{next(LONE)}", free_port()
    proc = spawn(
        "frontend", "--frontend-address", address, "--port", str(port), "--component-timeout", "1"
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + DEADLINE_S
        while status(url, "/health") != 200:
            assert proc.poll() is None, "the frontend exited during startup"
            assert time.monotonic() < deadline, "the frontend never answered /health"
            time.sleep(0.1)
        yield url, address
    finally:
        stop(proc)


def frontend_reads(url: str, address: str, context: zmq.Context[zmq.Socket[bytes]]) -> bool:
    """Whether the frontend still reads its ROUTER: a probe worker's heartbeats, first taking
    requests, then draining, move /metrics' count of workers to 1 and back to 0."""
    component = f"tokenizer-probe-{next(PINGS)}"
    probe = dealer(context, address, f"{component}-heartbeat")  # as a heartbeat thread is named
    session = os.urandom(8).hex()
    try:
        deadline = time.monotonic() + PROBE_DEADLINE_S
        for draining, count in ((False, 1), (True, 0)):
            while _num_workers(url) != count:
                if time.monotonic() > deadline:
                    return False
                beat = Heartbeat(
                    component=component,
                    pid=os.getpid(),
                    sent_at=time.time(),
                    session=session,
                    draining=draining,
                )
                probe.send(ENCODE(beat))
                time.sleep(0.05)
        return True
    finally:
        probe.close()


def _num_workers(url: str) -> int:
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r"^kvflow:num_tokenizer_workers\{[^}]*\} (\d+)", metrics, re.M)
    assert found is not None, "no kvflow:num_tokenizer_workers in /metrics"
    return int(found.group(1))


def test_the_frontend_survives_a_multi_part_frame(
    lone_frontend: tuple[str, str], context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    url, address = lone_frontend
    assert frontend_reads(url, address, context)
    fuzzer = dealer(context, address, "fuzz-parts")
    fuzzer.send_multipart([b"first part", b"second part"])
    fuzzer.close(linger=1000)
    assert frontend_reads(url, address, context)


def test_the_frontend_trusts_only_its_components(
    lone_frontend: tuple[str, str], context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    url, address = lone_frontend
    fuzzer = dealer(context, address, "fuzz-stranger")
    for message in [
        Heartbeat(component="fuzz-ghost", pid=1, sent_at=0.0),
        Heartbeat(component="scheduler", pid=1, sent_at=0.0, protocol_version=PROTOCOL_VERSION + 1),
        ComponentDown("scheduler", 1),
    ]:
        fuzzer.send(ENCODE(message))
        # Long enough for a fake component to fall silent (the component timeout is 1 s) and
        # for the watchdog to look: /health must stay 200 all along.
        until = time.monotonic() + 3
        while time.monotonic() < until:
            assert status(url, "/health") == 200, message
            time.sleep(0.2)
    fuzzer.close()
    assert frontend_reads(url, address, context)


@pytest.fixture
def lone_scheduler(
    folder: Path, context: zmq.Context[zmq.Socket[bytes]]
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A scheduler started alone, reading its ROUTER: no executor ever answers its hellos.
    (its ROUTER, it)"""
    n = next(LONE)
    address = f"ipc://{folder}/lone-scheduler-{n}"
    proc = spawn(
        "scheduler",
        "--frontend-address",
        f"ipc://{folder}/lone-nobody-{n}",
        "--scheduler-address",
        address,
    )
    try:
        # Started: its startup is not what the tests' shorter probes time.
        ready = dealer(context, address, f"fuzz-ready-{n}")
        started = scheduler_reads(ready, proc, timeout=DEADLINE_S)
        ready.close()
        assert started, "the scheduler never answered a request"
        yield address, proc
    finally:
        stop(proc)


def scheduler_reads(
    socket: zmq.Socket, proc: subprocess.Popen[bytes], timeout: float = PROBE_DEADLINE_S
) -> bool:
    """Whether a request sent on `socket` comes back refused ("the engine is still starting").
    One goes every second: a connection that was cut and comes back loses what it sent."""
    sent: set[str] = set()
    deadline, next_send = time.monotonic() + timeout, 0.0
    while time.monotonic() < deadline and proc.poll() is None:
        if time.monotonic() >= next_send:
            request_id, next_send = f"probe-{next(PINGS)}", time.monotonic() + 1
            request = EngineRequest(
                request_id=request_id, prompt_token_ids=[1], sampling_params=SamplingParams()
            )
            socket.send(ENCODE(request))
            sent.add(request_id)
        if socket.poll(100) and any(o.request_id in sent for o in outputs_of(socket.recv())):
            return True
    return False


def test_the_scheduler_survives_a_multi_part_frame(
    lone_scheduler: tuple[str, subprocess.Popen[bytes]],
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    address, proc = lone_scheduler
    probe = dealer(context, address, "fuzz-probe")
    assert scheduler_reads(probe, proc)
    probe.send_multipart([b"a", b"b"])
    assert scheduler_reads(probe, proc)


@pytest.mark.parametrize(
    "message",
    [
        pytest.param(ExecutorVersion(PROTOCOL_VERSION - 1), id="version-only"),
        pytest.param(
            ExecutorReady(
                protocol_version=PROTOCOL_VERSION - 1,
                model_name="x",
                vocab_size=1,
                eos_token_ids=[],
                max_model_len=1,
                block_size=16,
                num_blocks=1,
                max_num_seqs=1,
                max_num_batched_tokens=1,
            ),
            id="whole-report",
        ),
    ],
)
def test_the_scheduler_ignores_executor_messages_from_strangers(
    lone_scheduler: tuple[str, subprocess.Popen[bytes]],
    context: zmq.Context[zmq.Socket[bytes]],
    message: ExecutorVersion | ExecutorReady,
) -> None:
    address, proc = lone_scheduler
    probe = dealer(context, address, "fuzz-probe")
    assert scheduler_reads(probe, proc)
    probe.send(ENCODE(message))
    assert scheduler_reads(probe, proc)


def test_an_impostor_does_not_cut_the_real_component_off(
    lone_scheduler: tuple[str, subprocess.Popen[bytes]],
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    address, proc = lone_scheduler
    real = connect_dealer(context, address, "tokenizer-5")  # as the real worker connects
    assert scheduler_reads(real, proc)
    impostor = dealer(context, address, "tokenizer-5")
    assert scheduler_reads(impostor, proc)  # the identity is the impostor's now
    impostor.close()
    # Time for a fix to notice the dead connection and reconnect (ZMTP heartbeats: seconds).
    assert scheduler_reads(real, proc, timeout=2 * PROBE_DEADLINE_S)


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(INVALID_UTF8_TAG, id="non-utf8-tag"),
        pytest.param(INVALID_UTF8_ID, id="non-utf8-string"),
        pytest.param(None, id="deeply-nested"),
    ],
)
def test_a_frame_msgspec_chokes_on_is_dropped_not_raised(frame: bytes | None) -> None:
    for union in (ToScheduler, ToExecutor, FrontendToTokenizer, SchedulerToTokenizer, ToFrontend):
        for member in typing.get_args(union) or (union,):
            # Nested under one of the socket's own tags: another tag is refused before.
            data = frame or deeply_nested(member.__struct_config__.tag)
            assert Decoder(union, "fuzz").decode(data) is None, (union, data[:40])


def test_a_request_id_used_again_at_once_gets_consistent_plans() -> None:
    # What the scheduler fuzzing found (an id used twice, with an abort between, killed the
    # executor of `kvflow serve`), step by step through the engine loop's calls to the core.
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=64,
            block_size=16,
            max_model_len=1024,
            max_num_seqs=8,
            max_num_batched_tokens=64,
        )
    )
    held: set[str] = set()  # the requests the executor holds state for, plan after plan

    def executor_takes(plan: SchedulerOutput) -> None:  # as ModelRunner._apply_plan
        held.difference_update(plan.finished_request_ids)
        held.update(data.request_id for data in plan.new_requests)
        rows = [*(data.request_id for data in plan.cached_requests), *plan.num_scheduled_tokens]
        assert set(rows) <= held, f"plan {plan.step} runs {sorted(set(rows) - held)}, dropped"

    def request() -> EngineRequest:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        return EngineRequest(request_id="x", prompt_token_ids=[1, 2, 3], sampling_params=params)

    scheduler.add_request(request())
    first = scheduler.schedule()  # launched: it samples x's first token
    executor_takes(first)
    held_plan = scheduler.schedule()  # sent, held: x's first decode
    executor_takes(held_plan)
    scheduler.abort(["x"])  # its worker aborts x, then sends a request under the same id
    try:
        scheduler.add_request(request())
    except ParameterError:
        return  # refusing the id while the old request is on its way out is consistent too
    addendum = scheduler.schedule_addendum(held_plan)  # the engine loop's amend
    if addendum is not None:
        executor_takes(addendum)
    outputs = scheduler.update(first, ModelRunnerOutput(step=first.step, sampled={"x": [5]}))
    assert not [o for o in outputs if o.new_token_ids], "the old x's token went to the new x"
    executor_takes(scheduler.schedule())
