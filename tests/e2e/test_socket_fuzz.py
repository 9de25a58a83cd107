"""Fuzzing every ZeroMQ socket: no frame a peer sends takes a process down or stops it serving.

What this proves, with hypothesis making the frames (random bytes, random msgpack, messages of
every type of the socket's union with hostile but well-typed values: huge, negative, NaN,
empty, unknown ids; and the same messages damaged: a value anywhere made of the wrong type,
dropped or added, another or an unknown tag, a struct sent as an array, the encoding cut,
extended or altered; huge frames; multi-part messages where a DEALER receives them):

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

What the fuzzing found is pinned by tests of its own ("what the fuzzing found", and the last
test), each against a process of its own or in-process.
"""

from __future__ import annotations

import itertools
import math
import os
import re
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
import msgspec.inspect as mi
import pytest
import zmq
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared import protocol
from shared.ipc import Decoder, bind_router, connect_dealer
from shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequests,
    ComponentDown,
    EngineRequest,
    ExecutorReady,
    ExecutorVersion,
    FinishReason,
    FrontendToTokenizer,
    GenerateRequest,
    Heartbeat,
    LaunchStep,
    ModelRunnerOutput,
    NewRequestData,
    OutputBatch,
    ParameterError,
    RequestOutput,
    SamplingParams,
    SchedulerHello,
    SchedulerOutput,
    SchedulerToTokenizer,
    StatsSnapshot,
    TextDelta,
    TextDeltas,
    ToExecutor,
    ToFrontend,
    TokenizeRequest,
    TokenizeResult,
    ToScheduler,
)
from tests.e2e.server import API_KEY, Server, free_port

MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152  # the embedded model's
PROMPT = "The capital of France is"
DEADLINE_S = 60.0  # how long an answer may take before its process counts as stuck
PROBE_DEADLINE_S = 5.0  # the same, in the xfails, where a missing answer is the expected bug
ENGINE = ("scheduler", "executor-0")  # the components a frontend expects besides the workers
WORKER = "tokenizer-7"  # the standalone worker's name (--worker-index 7)
LIVE_IDS = [f"live-{k}" for k in range(4)]  # requests the standalone worker holds while fuzzed
ENCODE = msgspec.msgpack.Encoder().encode

# Examples per socket (each test may lower it): 2-10 s of the run each on 2 CPU cores.
FUZZ = settings(
    max_examples=60,
    deadline=None,
    # A process that died fails every example after it: shrinking would only mislead.
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=list(HealthCheck),
)

# ------------------------------------------------------------------ strategies

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1  # what msgpack (and msgspec) can carry
INTS = st.one_of(
    st.integers(0, 64),
    st.sampled_from([-1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, INT64_MIN, UINT64_MAX]),
    st.integers(INT64_MIN, UINT64_MAX),
)
FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 1e-300, 1e300, -1e300, math.nan, math.inf, -math.inf]),
    st.floats(0, 2),
    st.floats(),
)
TEXT = st.one_of(
    st.text(max_size=16),
    st.sampled_from(["", "\x00", "scheduler", "executor-0", "tokenizer-0", "live-0", "é" * 40]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    FLOATS,
    TEXT,
    st.binary(max_size=16),
    st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=12)),
)
MSGPACK = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT | INTS, inner, max_size=4),
    max_leaves=12,
)
TOKEN_IDS = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=12)

TAGGED = [  # every message a socket can receive, each with its own tag
    cls
    for cls in vars(protocol).values()
    if isinstance(cls, type)
    and issubclass(cls, msgspec.Struct)
    and cls.__struct_config__.tag is not None
    and cls is not ExecutorVersion  # ExecutorReady's tag: only its first field
]
TAGS = [cls.__struct_config__.tag for cls in TAGGED]
FIELD_NAMES = sorted({f.name for cls in TAGGED for f in msgspec.structs.fields(cls)})
Overrides = dict[str, st.SearchStrategy[Any]]
MARK = "\x01\x02\x03"  # a string that `damaged` finds in an encoding to replace


def typed(t: mi.Type, overrides: Overrides) -> st.SearchStrategy[Any]:
    """Values of type `t` a typed decoder accepts: well-typed, and as hostile as that allows."""
    if isinstance(t, mi.StructType):
        return struct_of(t.cls, overrides)
    if isinstance(t, mi.ListType):
        items = st.lists(typed(t.item_type, overrides), max_size=6)
        return st.one_of(TOKEN_IDS, items) if isinstance(t.item_type, mi.IntType) else items
    if isinstance(t, mi.DictType):
        keys, values = typed(t.key_type, overrides), typed(t.value_type, overrides)
        return st.dictionaries(keys, values, max_size=4)
    if isinstance(t, mi.UnionType):
        return st.one_of(*(typed(member, overrides) for member in t.types))
    if isinstance(t, mi.EnumType):
        return st.sampled_from(list(t.cls))
    scalars: dict[type[mi.Type], st.SearchStrategy[Any]] = {
        mi.IntType: INTS,
        mi.FloatType: FLOATS,
        mi.StrType: TEXT,
        mi.BoolType: st.booleans(),
        mi.NoneType: st.none(),
        mi.BytesType: st.binary(max_size=40),
    }
    return scalars[type(t)]


def struct_of(cls: type[msgspec.Struct], overrides: Overrides | None = None) -> st.SearchStrategy:
    """Instances of `cls`; `overrides` draws the fields of that name (in nested structs too)."""
    overrides = overrides or {}
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    fields = {f.name: overrides.get(f.name, typed(f.type, overrides)) for f in info.fields}
    required = {f.name for f in info.fields if f.required}
    return st.fixed_dictionaries(
        {name: fields[name] for name in required},
        optional={name: s for name, s in fields.items() if name not in required},
    ).map(lambda kwargs: cls(**kwargs))


def messages_of(union: Any, overrides: Overrides | None = None) -> st.SearchStrategy:
    return st.one_of(*(struct_of(cls, overrides) for cls in typing.get_args(union) or (union,)))


def _slots(tree: Any) -> Iterator[tuple[Any, Any]]:
    """(container, key) of every value in a msgpack tree, nested ones too."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in list(items):
        yield tree, key
        if isinstance(value, dict | list):
            yield from _slots(value)


@st.composite
def damaged(draw: st.DrawFn, messages: st.SearchStrategy) -> bytes:
    """A message made unreadable, or nearly: a value anywhere in it replaced (mostly by one
    of the wrong type), dropped or added, a huge value put in, its tag changed, the struct sent
    as an array, a string (the tag too) made of bytes that are not UTF-8, maps nested thousands
    deep put in; or its encoding cut short, extended, or one byte of it changed."""
    tree = msgspec.to_builtins(draw(messages))
    how = draw(
        st.sampled_from(
            ["replace", "drop", "add", "huge", "tag", "array", "bytes", "non-utf8", "nest"]
        )
    )
    slots = list(_slots(tree))
    if how in ("non-utf8", "nest"):
        strings = [(c, k) for c, k in slots if isinstance(c[k], str)]
        container, key = draw(st.sampled_from(strings)) if strings else (tree, "x")
        container[key] = MARK  # replaced in the encoding below
    elif how in ("replace", "drop", "huge") and slots:
        container, key = draw(st.sampled_from(slots))
        if how == "drop":
            del container[key]
        else:
            huge = st.sampled_from([[7] * 300_000, ["x"] * 100_000, "x" * 2_000_000, {}])
            container[key] = draw(huge if how == "huge" else MSGPACK)
    elif how == "add":
        tree[draw(st.sampled_from(FIELD_NAMES) | TEXT)] = draw(MSGPACK)
    elif how == "tag":
        tree["type"] = draw(st.sampled_from(TAGS) | TEXT | MSGPACK)
    elif how == "array":
        tree = list(tree.values())
    data = ENCODE(tree)
    if how == "non-utf8":  # as long as the mark: the string's length still holds
        return data.replace(MARK.encode(), b"\xff\x80\xfe", 1)
    if how == "nest":
        return data.replace(ENCODE(MARK), nested(draw(st.integers(100, 5000))), 1)
    if how != "bytes":
        return data
    at = draw(st.integers(0, len(data) - 1))
    edit = draw(st.sampled_from(["cut", "extend", "change"]))
    if edit == "cut":
        return data[:at]
    if edit == "extend":
        return data + draw(st.binary(min_size=1, max_size=8))
    return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]


def frames_for(
    union: Any, overrides: Overrides | None = None, intact: tuple[type, ...] | None = None
) -> st.SearchStrategy[bytes]:
    """One frame for a socket that decodes `union`; of its messages, only those of `intact`
    (default: all) are also sent well-typed, the others only damaged."""
    messages = messages_of(union, overrides)
    whole = messages if intact is None else st.one_of(*(struct_of(c, overrides) for c in intact))
    return st.one_of(
        st.binary(max_size=512),
        MSGPACK.map(ENCODE),
        st.tuples(
            st.sampled_from(TAGS), st.dictionaries(st.sampled_from(FIELD_NAMES) | TEXT, MSGPACK)
        ).map(lambda tag_fields: ENCODE({**tag_fields[1], "type": tag_fields[0]})),
        whole.map(ENCODE),
        st.sampled_from(TAGGED).flatmap(struct_of).map(ENCODE),  # mostly another socket's
        damaged(messages),
    )


def nested(depth: int) -> bytes:
    """`depth` maps, each inside the last: a few bytes each, and no field type bounds them."""
    return b"\x81\xa1a" * depth + b"\xc0"


def deeply_nested(tag: str, depth: int = 5000) -> bytes:
    """A message tagged `tag` with an unknown field that nests `depth` maps."""
    return ENCODE({"type": tag, "x": None})[:-1] + nested(depth)


VALID_HOSTILE_REQUESTS = st.builds(
    EngineRequest,
    request_id=st.uuids().map(lambda u: f"fuzz-{u}"),
    prompt_token_ids=TOKEN_IDS,
    sampling_params=st.builds(
        SamplingParams,
        temperature=st.sampled_from([0.0, 1e-30, 1.0, 1e30, math.inf]),
        top_p=st.sampled_from([1e-30, 0.5, 1.0]),
        top_k=st.none() | st.sampled_from([1, 2, VOCAB_SIZE, 10**9, UINT64_MAX]),
        min_p=st.sampled_from([0.0, 0.5, 1.0]),
        seed=st.none() | st.sampled_from([0, -1, INT64_MIN, UINT64_MAX]),
        presence_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
        frequency_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
        repetition_penalty=st.sampled_from([1e-30, 1.0, 1e30, math.inf]),
        logit_bias=st.none() | st.dictionaries(st.integers(0, VOCAB_SIZE - 1), FLOATS, max_size=3),
        logprobs=st.none() | st.sampled_from([0, 20, VOCAB_SIZE]),
        max_tokens=st.none() | st.integers(1, 4),
        min_tokens=st.integers(0, 2),
        stop_token_ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3),
        ignore_eos=st.booleans(),
        stop=st.lists(TEXT, max_size=3),
        n=st.integers(1, 3),
    ),
    arrival_time=FLOATS,
)


def decoded(union: Any, frame: bytes) -> object:
    """What a socket's decoder makes of `frame`: a message, None (dropped), or what escapes it."""
    try:
        return msgspec.msgpack.decode(frame, type=union)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    except Exception as exc:
        return exc


def tally(union: Any, frames: list[bytes]) -> None:
    """Count what was sent, by what the socket's decoder makes of it (hypothesis statistics)."""
    for frame in frames:
        message = decoded(union, frame)
        event("malformed" if message is None else type(message).__name__)


FRONTEND_FRAMES = frames_for(
    ToFrontend,
    {
        "component": st.sampled_from([*ENGINE, "tokenizer-0"]) | TEXT.map("tokenizer-".__add__),
        "protocol_version": st.just(PROTOCOL_VERSION),
    },
    intact=(TextDelta, TextDeltas, TokenizeResult, Heartbeat, StatsSnapshot),
)
SCHEDULER_FRAMES = st.one_of(
    frames_for(ToScheduler, intact=(EngineRequest, AbortRequests)),
    VALID_HOSTILE_REQUESTS.map(ENCODE),
)
# A DEALER reads a multi-part message one part at a time: each part is a frame of its own.
WORKER_FRONTEND_FRAMES = st.lists(frames_for(FrontendToTokenizer), min_size=1, max_size=3)
WORKER_SCHEDULER_FRAMES = st.lists(
    frames_for(SchedulerToTokenizer, {"request_id": st.sampled_from(LIVE_IDS) | TEXT}),
    min_size=1,
    max_size=3,
)
EXECUTOR_FRAMES = st.lists(
    frames_for(ToExecutor, intact=(SchedulerHello,)),
    min_size=1,
    max_size=3,
)
HUGE_RANDOM = os.urandom(8 << 20)
# AbortRequests, with its tag or its one id made of a byte that is not UTF-8.
INVALID_UTF8_TAG = ENCODE(AbortRequests(["x"])).replace(
    b"\xadAbortRequests", b"\xad\x80bortRequests"
)
INVALID_UTF8_ID = ENCODE(AbortRequests(["x"])).replace(b"\xa1x", b"\xa1\x80")


# ------------------------------------------------------------------ processes

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
        return int(answer.sampled["r"])


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
# Each against a process of its own or in-process (the last test of this file ends `kvflow
# serve` where the bug is back).

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
def lone_scheduler(folder: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A scheduler started alone: no executor ever answers its hellos. (its ROUTER, it)"""
    n = next(LONE)
    address = f"ipc://{folder}/lone-scheduler-{n}"
    proc = spawn(
        "scheduler",
        "--frontend-address",
        f"ipc://{folder}/lone-nobody-{n}",
        "--scheduler-address",
        address,
    )
    yield address, proc
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
    outputs = scheduler.update(first, ModelRunnerOutput(step=first.step, sampled={"x": 5}))
    assert not [o for o in outputs if o.new_token_ids], "the old x's token went to the new x"
    executor_takes(scheduler.schedule())


def inconsistent_plans(report: ExecutorReady) -> dict[str, list[msgspec.Struct]]:
    """Well-typed messages that no scheduler of this executor's session would send."""

    def plan(tokens: list[int], blocks: list[int], **sampling: Any) -> SchedulerOutput:
        data = NewRequestData(
            request_id="r",
            prompt_token_ids=tokens,
            output_token_ids=[],
            sampling_params=SamplingParams(temperature=0.0, **sampling),
            block_ids=blocks,
            num_computed_tokens=0,
        )
        return SchedulerOutput(
            step=1,
            new_requests=[data],
            cached_requests=[],
            num_scheduled_tokens={"r": len(tokens)},
            finished_request_ids=[],
        )

    unknown = plan([1, 2], [0])
    unknown.num_scheduled_tokens = {"never-sent": 1}
    too_many = plan([1, 2], [0])
    too_many.num_scheduled_tokens = {"r": 50}
    return {
        "a block id past the cache": [plan([1, 2], [report.num_blocks]), LaunchStep(1)],
        "a token id past the vocabulary": [plan([report.vocab_size], [0]), LaunchStep(1)],
        "top_k 0": [plan([1, 2], [0], top_k=0), LaunchStep(1)],
        "a launch of a plan never sent": [LaunchStep(9)],
        "a request never sent": [unknown, LaunchStep(1)],
        "more tokens than the request has": [too_many, LaunchStep(1)],
    }


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


def outputs_of(frame: bytes) -> list[RequestOutput]:
    """The request outputs of a frame the scheduler sent a tokenizer worker (none in the answer
    to a LoRA adapter request, which the fuzzer may have sent)."""
    message = msgspec.msgpack.decode(frame, type=SchedulerToTokenizer)
    return message.outputs if isinstance(message, OutputBatch) else []


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
