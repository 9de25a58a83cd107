"""Fuzzing every ZeroMQ socket: no frame a peer sends takes a process down or stops it serving.

What this proves, with hypothesis making the frames (tests/e2e/fuzz_frames.py: random bytes, random
msgpack, messages of every type of the socket's union with hostile but well-typed values: huge,
negative, NaN, empty, unknown ids; and the same messages damaged: a value anywhere made of the
wrong type, dropped or added, another or an unknown tag, a struct sent as an array, the encoding
cut, extended or altered; huge frames; multi-part messages where a DEALER receives them):

- The two ROUTERs of one real `kvflow serve`, the frontend's and the scheduler's, reached by
  DEALERs under identities no component uses: after every example the socket's process still
  answers through it (a ping), and after the run every process is the one that started, /health
  and /ready are 200, nothing is left running, and the official `openai` client gets the
  right completion.
- What a tokenizer worker receives from a frontend and from the scheduler, and what an
  executor receives from the scheduler: each is started alone against ROUTERs this test binds
  (the test plays the frontend and the scheduler), fuzzed the same way, and afterwards still
  tokenizes, admits and detokenizes a real request (the worker), or adopts a scheduler and runs
  a real plan to the right token (the executor).
- `shared.ipc.Decoder`, every socket's decoder, returns None for what it cannot read, in-process.

What the fuzzing found is pinned by tests of its own, each against a process of its own or
in-process (tests/e2e/test_socket_fuzz_findings.py), or against this module's (the executor's
"what the fuzzing found" below, and the last test).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from shared.ipc import Decoder
from shared.protocol import (
    AbortRequests,
    EngineRequest,
    FinishReason,
    FrontendToTokenizer,
    GenerateRequest,
    ModelRunnerOutput,
    OutputBatch,
    RequestOutput,
    SamplingParams,
    SchedulerHello,
    SchedulerToTokenizer,
    TextDelta,
    TextDeltas,
    ToExecutor,
    ToFrontend,
    ToScheduler,
)
from tests.e2e.fuzz_frames import (
    ENCODE,
    EXECUTOR_FRAMES,
    FRONTEND_FRAMES,
    FUZZ,
    HUGE_RANDOM,
    INVALID_UTF8_ID,
    INVALID_UTF8_TAG,
    SCHEDULER_FRAMES,
    UINT64_MAX,
    VOCAB_SIZE,
    WORKER_FRONTEND_FRAMES,
    WORKER_SCHEDULER_FRAMES,
    decoded,
    deeply_nested,
    frames_for,
    inconsistent_plans,
    tally,
)
from tests.e2e.fuzz_processes import (
    DEADLINE_S,
    PINGS,
    PROMPT,
    Executor,
    Worker,
    dealer,
    outputs_of,
    status,
    stop,
)
from tests.e2e.fuzz_processes import context as context  # fixtures: `as` marks them used
from tests.e2e.fuzz_processes import folder as folder
from tests.e2e.server import API_KEY, Server, free_port

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def worker(folder: Path, context: zmq.Context[zmq.Socket[bytes]]) -> Iterator[Worker]:
    worker = Worker(folder, context)
    yield worker
    stop(worker.proc)


@pytest.fixture(scope="module")
def executor(folder: Path, context: zmq.Context[zmq.Socket[bytes]]) -> Iterator[Executor]:
    executor = Executor(folder, context)
    yield executor
    stop(executor.proc)


@pytest.fixture(scope="module")
def serving(folder: Path) -> Iterator[Server]:
    """`kvflow serve` as tests.e2e.server starts it, on ipc:// addresses of this test's choosing,
    not waited for (`server` waits)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    flags = {
        "--port": str(port),
        "--api-key": API_KEY,
        "--max-model-len": "1024",
        "--frontend-address": f"ipc://{folder}/frontend",
        "--scheduler-address": f"ipc://{folder}/scheduler",
        "--tokenizer-pool-size": "1",
        "--kv-cache-memory-bytes": str(128 << 20),
        "--drain-timeout": "2",  # what the last test leaves stops quickly
    }
    argv = [sys.executable, "-m", "services", "serve", *itertools.chain(*flags.items())]
    server = Server(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL), port)
    yield server
    server.stop()


@pytest.fixture(scope="module", autouse=True)
def everything_starts_at_once(serving: Server, worker: Worker, executor: Executor) -> None:
    """Every process of this module starts before its first test: the tokenizers and the model
    load side by side, and the tests of the processes ready first run while the rest load."""


@pytest.fixture(scope="module")
def server(serving: Server) -> Server:
    deadline = time.monotonic() + 600  # loading, on a busy machine
    while status(serving.url, "/ready") != 200:
        assert serving.proc.poll() is None, f"kvflow serve exited with {serving.proc.returncode}"
        assert time.monotonic() < deadline, "kvflow serve never became ready"
        time.sleep(0.25)
    return serving


@pytest.fixture(scope="module")
def pids(server: Server) -> dict[str, int]:
    """Each component's process when the fuzzing starts: the same must serve at the end."""
    return {c: server.child_pid(c) for c in ("frontend", "scheduler", "executor", "tokenizer")}


@pytest.fixture(scope="module")
def frontend_fuzzer(
    server: Server, pids: dict[str, int], folder: Path, context: zmq.Context[zmq.Socket[bytes]]
) -> Iterator[zmq.Socket]:
    socket = dealer(context, f"ipc://{folder}/frontend", "fuzz-frontend")
    yield socket
    socket.close()


@pytest.fixture(scope="module")
def scheduler_fuzzers(
    server: Server, pids: dict[str, int], folder: Path, context: zmq.Context[zmq.Socket[bytes]]
) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """(the fuzzer, a probe that pings through the same ROUTER)."""
    fuzzer = dealer(context, f"ipc://{folder}/scheduler", "fuzz-scheduler")
    probe = dealer(context, f"ipc://{folder}/scheduler", "fuzz-probe")
    yield fuzzer, probe
    fuzzer.close()
    probe.close()


# ------------------------------------------------------------------ a tokenizer worker


@FUZZ
@example(frames=[HUGE_RANDOM])
@example(frames=[deeply_nested("TokenizeRequest"), INVALID_UTF8_TAG, INVALID_UTF8_ID])
@example(frames=[b"", ENCODE(GenerateRequest(request_id="x", sampling_params=SamplingParams()))])
@given(frames=WORKER_FRONTEND_FRAMES)
def test_a_tokenizer_worker_survives_fuzzing_from_a_frontend(
    worker: Worker, frames: list[bytes]
) -> None:
    worker.wait_ready()
    tally(FrontendToTokenizer, frames)
    worker.send(worker.frontend, frames)
    assert worker.tokenize(PROMPT) == worker.prompt_ids


@FUZZ
@example(frames=[deeply_nested("OutputBatch")])
@example(
    frames=[
        ENCODE(
            OutputBatch(
                [RequestOutput(request_id="live-0", new_token_ids=[VOCAB_SIZE, -1, UINT64_MAX])]
            )
        )
    ]
)
@given(frames=WORKER_SCHEDULER_FRAMES)
def test_a_tokenizer_worker_survives_fuzzing_from_the_scheduler(
    worker: Worker, frames: list[bytes]
) -> None:
    worker.wait_ready()
    worker.admit_live_requests()
    tally(SchedulerToTokenizer, frames)
    worker.send(worker.scheduler, frames)
    assert worker.tokenize(PROMPT) == worker.prompt_ids


def test_after_the_fuzzing_the_tokenizer_worker_still_serves(worker: Worker) -> None:
    worker.wait_ready()
    assert worker.tokenize(PROMPT) == worker.prompt_ids
    paris = worker.tokenize(" Paris", add_special_tokens=False)
    request = GenerateRequest(
        request_id="final", sampling_params=SamplingParams(temperature=0.0), prompt=PROMPT
    )
    worker.send(worker.frontend, [ENCODE(request)])
    admitted = worker.receive(
        lambda m: isinstance(m, EngineRequest) and m.request_id == "final", "the admitted request"
    )
    assert admitted.prompt_token_ids == worker.prompt_ids
    output = RequestOutput(
        request_id="final",
        new_token_ids=paris,
        finish_reason=FinishReason.LENGTH,
        num_prompt_tokens=len(worker.prompt_ids),
    )
    worker.send(worker.scheduler, [ENCODE(OutputBatch([output]))])
    batch = worker.receive(
        lambda m: isinstance(m, TextDeltas) and m.deltas[0].request_id == "final",
        "the request's text",
    )
    (delta,) = batch.deltas
    assert (delta.text, delta.finish_reason, delta.error) == (" Paris", FinishReason.LENGTH, None)


# ------------------------------------------------------------------ an executor


@FUZZ
@example(frames=[HUGE_RANDOM])
@example(frames=[b"", ENCODE(SchedulerHello(UINT64_MAX)), ENCODE({"type": "LaunchStep"})])
@given(frames=EXECUTOR_FRAMES)
def test_an_executor_survives_fuzzing_from_the_scheduler(
    executor: Executor, frames: list[bytes]
) -> None:
    executor.wait_ready()
    tally(ToExecutor, frames)
    executor.send(frames)
    executor.hello()  # a fuzzed hello may have adopted it: this one adopts it back


def test_after_the_fuzzing_the_executor_still_serves(executor: Executor, worker: Worker) -> None:
    executor.wait_ready()
    worker.wait_ready()
    paris = worker.tokenize(" Paris", add_special_tokens=False)
    assert executor.greedy_token(worker.prompt_ids) == paris[0]


# ------------------------------------------------------------------ the codec


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    union=st.sampled_from(
        [ToScheduler, ToExecutor, FrontendToTokenizer, SchedulerToTokenizer, ToFrontend]
    ),
    data=st.data(),
)
def test_every_decoder_drops_what_it_cannot_read(union: Any, data: st.DataObject) -> None:
    frame = data.draw(frames_for(union))
    message = Decoder(union, "fuzz").decode(frame)
    assert message is None or isinstance(message, typing.get_args(union) or union)


# ------------------------------------------------------------------ what the fuzzing found
# In this module's executor (the rest: tests/e2e/test_socket_fuzz_findings.py).


def test_the_executor_survives_inconsistent_plans(executor: Executor) -> None:
    report = executor.wait_ready()
    for what, messages in inconsistent_plans(report).items():
        executor.adopt()
        executor.send([ENCODE(m) for m in messages])
        assert executor.proc.poll() is None, what
        executor.hello()


# ------------------------------------------------------------------ kvflow serve


def frontend_answers(server: Server) -> None:
    """/tokenize goes through the frontend's ROUTER both ways (to a worker and back). A fuzzed
    heartbeat may say a real component is stalled or draining until its next beat: retry."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        assert server.proc.poll() is None, f"kvflow serve exited with {server.proc.returncode}"
        try:
            response = httpx.post(
                f"{server.url}/tokenize",
                json={"model": MODEL, "prompt": PROMPT},
                headers=server.headers(),
                timeout=DEADLINE_S,
            )
            if response.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the frontend stopped answering /tokenize"
        time.sleep(0.02)


# A ROUTER's process reads one frame per message (a multi-part one is dropped whole: see
# test_the_frontend_survives_a_multi_part_frame): the frames of an example go as messages of
# their own, a ping after them all.
@settings(FUZZ, max_examples=50)  # each ping is an HTTP call through a worker
@example(frames=[HUGE_RANDOM])
@example(frames=[ENCODE(TextDelta(request_id="x", text="x" * (4 << 20), token_ids=[1] * 10**6))])
@example(frames=[b""])
@given(frames=st.lists(FRONTEND_FRAMES, min_size=1, max_size=4))
def test_the_frontend_router_survives_fuzzing(
    server: Server, frontend_fuzzer: zmq.Socket, frames: list[bytes]
) -> None:
    tally(ToFrontend, frames)
    for frame in frames:
        frontend_fuzzer.send(frame)
    frontend_answers(server)


def scheduler_answers(server: Server, probe: zmq.Socket) -> None:
    """A request it refuses at once (an empty prompt): the refusal comes back on the probe."""
    request_id = f"probe-{next(PINGS)}"
    request = EngineRequest(
        request_id=request_id, prompt_token_ids=[], sampling_params=SamplingParams()
    )
    probe.send(ENCODE(request))
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, f"kvflow serve exited with {server.proc.returncode}"
        if probe.poll(100) and any(o.request_id == request_id for o in outputs_of(probe.recv())):
            return
    pytest.fail("the scheduler stopped answering")


@settings(FUZZ, max_examples=30)  # the requests that pass validation run a step or two
@example(frames=[HUGE_RANDOM])
@example(
    frames=[
        ENCODE(
            EngineRequest(
                request_id="x", prompt_token_ids=[1] * 10**6, sampling_params=SamplingParams()
            )
        )
    ]
)
@given(frames=st.lists(SCHEDULER_FRAMES, min_size=1, max_size=4))
def test_the_scheduler_router_survives_fuzzing(
    server: Server, scheduler_fuzzers: tuple[zmq.Socket, zmq.Socket], frames: list[bytes]
) -> None:
    fuzzer, probe = scheduler_fuzzers
    # A request id is never used twice: hypothesis repeats values, so each request that would
    # be admitted gets a suffix of its own (test_a_request_id_used_again_at_once_gets_...).
    frames = [unique_request(frame) for frame in frames]
    requests = [decoded(ToScheduler, frame) for frame in frames]
    waiting = {r.request_id for r in requests if isinstance(r, EngineRequest)}
    tally(ToScheduler, frames)
    for frame in frames:
        fuzzer.send(frame)
    if waiting:
        # Its first output says what became of a request: refused, or it ran a step on the
        # real executor (hostile sampling parameters reach the sampler). Then stop it, so
        # the run does not pile up work.
        ran = until_outputs(server, fuzzer, waiting)
        event("a fuzzed request ran" if ran else "a fuzzed request was refused")
        fuzzer.send(ENCODE(AbortRequests(sorted(ran))))
    scheduler_answers(server, probe)


def unique_request(frame: bytes) -> bytes:
    request = decoded(ToScheduler, frame)
    if not isinstance(request, EngineRequest):
        return frame
    return ENCODE(
        msgspec.structs.replace(request, request_id=f"{request.request_id}#{next(PINGS)}")
    )


def until_outputs(server: Server, fuzzer: zmq.Socket, request_ids: set[str]) -> set[str]:
    """Read the fuzzer's outputs until each request has one; returns those that got tokens."""
    waiting, ran = set(request_ids), set()
    deadline = time.monotonic() + DEADLINE_S
    while waiting:
        assert server.proc.poll() is None, f"kvflow serve exited with {server.proc.returncode}"
        assert time.monotonic() < deadline, f"no output for {sorted(waiting)}"
        if fuzzer.poll(100):
            for output in outputs_of(fuzzer.recv()):
                waiting.discard(output.request_id)
                if output.new_token_ids:
                    ran.add(output.request_id)
    return ran


def test_after_the_fuzzing_every_process_still_serves(server: Server, pids: dict[str, int]) -> None:
    for component, pid in pids.items():
        assert server.child_pid(component) == pid, f"{component} is not the process that started"
    # A fuzzed heartbeat may have said a component stalls or drains: its next beat says not.
    deadline = time.monotonic() + DEADLINE_S
    while (status(server.url, "/health"), status(server.url, "/ready")) != (200, 200):
        assert time.monotonic() < deadline, "/health or /ready never came back to 200"
        time.sleep(0.1)
    client = server.client(timeout=DEADLINE_S, max_retries=0)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text.startswith(" Paris")
    # Every fuzzed request that ran was aborted: nothing runs, waits, or holds a KV block.
    metrics = server.wait_idle(timeout=DEADLINE_S)
    assert (metrics["num_requests_running"], metrics["num_requests_waiting"]) == (0, 0)
    assert metrics["kv_cache_usage_perc"] == 0


def test_the_scheduler_ignores_step_answers_from_strangers(
    server: Server, pids: dict[str, int], folder: Path, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    # Last in this file: with the bug, it ends the module's `kvflow serve`.
    stranger = dealer(context, f"ipc://{folder}/scheduler", "fuzz-stranger")
    for step in range(20_000):  # the steps to come, whatever the fuzzing above ran
        stranger.send(ENCODE(ModelRunnerOutput(step=step, sampled={})))
    client = server.client(timeout=DEADLINE_S, max_retries=0)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text.startswith(" Paris")
