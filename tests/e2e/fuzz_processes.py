"""The processes of tests/e2e/test_socket_fuzz.py and what talks to them: components started
alone, DEALERs made as anything that reaches a socket could make them, a tokenizer worker and an
executor each between ROUTERs the test binds and plays, and the fixtures both modules share."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from shared.ipc import bind_router
from shared.protocol import (
    ExecutorReady,
    GenerateRequest,
    LaunchStep,
    ModelRunnerOutput,
    NewRequestData,
    OutputBatch,
    RequestOutput,
    SamplingParams,
    SchedulerHello,
    SchedulerOutput,
    SchedulerToTokenizer,
    TokenizeRequest,
    TokenizeResult,
)
from tests.e2e.fuzz_frames import ENCODE, LIVE_IDS, TAGGED

PROMPT = "The capital of France is"
DEADLINE_S = 60.0  # how long an answer may take before its process counts as stuck
WORKER = "tokenizer-7"  # the standalone worker's name (--worker-index 7)
PINGS = itertools.count()  # numbers ping requests (and makes fuzzed request ids unique)


def spawn(component: str, *flags: str) -> subprocess.Popen[bytes]:
    """`kvflow <component>` alone; its log goes to this test's stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    return subprocess.Popen(
        [sys.executable, "-m", "services", component, *flags],
        env=env,
        stdout=subprocess.DEVNULL,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def status(url: str, path: str) -> int | None:
    """An HTTP GET's status code, or None when nothing answers."""
    try:
        return httpx.get(url + path, timeout=10).status_code
    except httpx.HTTPError:
        return None


def dealer(context: zmq.Context[zmq.Socket[bytes]], address: str, identity: str) -> zmq.Socket:
    """A plain DEALER (not `shared.ipc`'s), as anything that reaches a socket could make."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, identity.encode())
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


# Every message this test may read back; a union of a list of types needs typing.Union.
ANY_MESSAGE = msgspec.msgpack.Decoder(typing.Union[tuple(TAGGED)])  # noqa: UP007


def receive(
    sockets: list[zmq.Socket],
    want: Callable[[Any], bool],
    procs: list[subprocess.Popen[bytes]],
    what: str,
    timeout: float = DEADLINE_S,
) -> Any:
    """The first message on `sockets` that `want` accepts (everything else is read and dropped,
    so no queue fills); fails at once when one of `procs` exits, or after `timeout`."""
    poller = zmq.Poller()
    for socket in sockets:
        poller.register(socket, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, f"{what}: the process exited with {proc.returncode}"
        for socket, _ in poller.poll(100):
            frame = socket.recv_multipart()[-1]
            try:
                message = ANY_MESSAGE.decode(frame)
            except msgspec.MsgspecError:
                continue
            if want(message):
                return message
    pytest.fail(f"{what}: no answer in {timeout:.0f} s")


def outputs_of(frame: bytes) -> list[RequestOutput]:
    """The request outputs of a frame the scheduler sent a tokenizer worker (none in the answer
    to a LoRA adapter request, which the fuzzer may have sent)."""
    message = msgspec.msgpack.decode(frame, type=SchedulerToTokenizer)
    return message.outputs if isinstance(message, OutputBatch) else []


class Worker:
    """A tokenizer worker started alone, between two ROUTERs this test binds and plays: the
    frontend's and the scheduler's."""

    def __init__(self, folder: Path, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.frontend = bind_router(context, f"ipc://{folder}/worker-frontend")
        self.scheduler = bind_router(context, f"ipc://{folder}/worker-scheduler")
        self.ready_file = folder / "worker-ready"
        self.proc = spawn(
            "tokenizer",
            "--frontend-address",
            f"ipc://{folder}/worker-frontend",
            "--scheduler-address",
            f"ipc://{folder}/worker-scheduler",
            "--worker-index",
            WORKER.removeprefix("tokenizer-"),
            "--ready-file",
            str(self.ready_file),
            "--drain-timeout",
            "1",
        )
        self.ids = itertools.count()
        self.prompt_ids: list[int] = []  # PROMPT, as the worker tokenized it before any fuzzing

    def wait_ready(self) -> None:
        if self.prompt_ids:
            return
        deadline = time.monotonic() + 300  # loading the tokenizer, on a busy machine
        while not self.ready_file.exists():
            assert self.proc.poll() is None, "the tokenizer worker exited during startup"
            assert time.monotonic() < deadline, "the tokenizer worker never became ready"
            time.sleep(0.1)
        self.prompt_ids = self.tokenize(PROMPT)

    def send(self, router: zmq.Socket, frames: list[bytes]) -> None:
        # ROUTER_MANDATORY: until the worker's DEALER has connected, this raises; retry.
        deadline = time.monotonic() + DEADLINE_S
        while True:
            try:
                router.send_multipart([WORKER.encode(), *frames])
                return
            except zmq.ZMQError:
                assert self.proc.poll() is None, "the tokenizer worker exited"
                assert time.monotonic() < deadline, "the tokenizer worker is unreachable"
                time.sleep(0.05)

    def receive(self, want: Callable[[Any], bool], what: str) -> Any:
        return receive([self.frontend, self.scheduler], want, [self.proc], what)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        request_id = f"ping-{next(self.ids)}"
        request = TokenizeRequest(
            request_id=request_id, prompt=text, add_special_tokens=add_special_tokens
        )
        self.send(self.frontend, [ENCODE(request)])
        result = self.receive(
            lambda m: isinstance(m, TokenizeResult) and m.request_id == request_id, "tokenize"
        )
        assert result.error is None, result.error
        return list(result.token_ids)

    def admit_live_requests(self) -> None:
        """(Re)admit the requests that the fuzzed outputs name, so they reach a detokenizer."""
        for request_id in LIVE_IDS:
            request = GenerateRequest(
                request_id=request_id, sampling_params=SamplingParams(stop=["o"]), prompt=PROMPT
            )
            self.send(self.frontend, [ENCODE(request)])


class Executor:
    """An executor started alone, connected to a ROUTER this test binds and plays: the
    scheduler's."""

    def __init__(self, folder: Path, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.router = bind_router(context, f"ipc://{folder}/executor-scheduler")
        self.proc = spawn(
            "executor",
            "--frontend-address",
            f"ipc://{folder}/executor-frontend",  # nobody binds it: heartbeats wait there
            "--scheduler-address",
            f"ipc://{folder}/executor-scheduler",
            "--max-model-len",
            "1024",
            "--kv-cache-memory-bytes",
            str(64 << 20),
        )
        self.sessions = itertools.count(1)
        self.session = 0
        self.report: ExecutorReady | None = None

    def wait_ready(self) -> ExecutorReady:
        if self.report is None:  # loading the model: minutes at worst on a busy machine
            self.report = receive(
                [self.router],
                lambda m: isinstance(m, ExecutorReady) and m.session is None,
                [self.proc],
                "the executor's unasked ExecutorReady",
                timeout=600,
            )
            self.adopt()
        return self.report

    def send(self, frames: list[bytes]) -> None:
        self.router.send_multipart([b"executor-0", *frames])

    def hello(self) -> None:
        """Say hello under the current session; the executor must answer it."""
        self.send([ENCODE(SchedulerHello(self.session))])
        session = self.session
        receive(
            [self.router],
            lambda m: isinstance(m, ExecutorReady) and m.session == session,
            [self.proc],
            f"hello of session {session}",
        )

    def adopt(self) -> None:
        """A new scheduler session: the executor forgets every request and step."""
        self.session = next(self.sessions)
        self.hello()

    def greedy_token(self, prompt_ids: list[int]) -> int:
        """Run one plan, as the scheduler would send it, and return the token it samples."""
        self.adopt()
        blocks = -(-len(prompt_ids) // 16)
        plan = SchedulerOutput(
            step=1,
            new_requests=[
                NewRequestData(
                    request_id="r",
                    prompt_token_ids=prompt_ids,
                    output_token_ids=[],
                    sampling_params=SamplingParams(temperature=0.0),
                    block_ids=list(range(blocks)),
                    num_computed_tokens=0,
                )
            ],
            cached_requests=[],
            num_scheduled_tokens={"r": len(prompt_ids)},
            finished_request_ids=[],
        )
        self.send([ENCODE(plan)])
        self.send([ENCODE(LaunchStep(1))])
        answer = receive(
            [self.router],
            lambda m: isinstance(m, ModelRunnerOutput) and m.step == 1,
            [self.proc],
            "a plan's answer",
        )
        return int(answer.sampled["r"][0])


# Module-scoped, each test module imports them: one folder and one context per module.
@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    # Short: an ipc:// path must fit in a socket address (about 100 bytes).
    path = Path(tempfile.mkdtemp(prefix="kvfuzz-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)
