"""The scheduler process: sockets around the engine loop.

It binds one ROUTER. Tokenizer workers send requests and aborts through it and get their
requests' outputs back; the executor connects to it, reports what it loaded (ExecutorReady),
then receives one plan per step and answers each with the sampled tokens.

The loop is `EngineCore`, the same as offline; only the executor differs: `RemoteExecutor`
sends plans over the socket and launches each when the executor's device is ready for it,
holding it until then so that requests arriving meanwhile can join it (`EngineCore.amend`).

Either side may restart (compose and Kubernetes restart a container that dies). The scheduler
adopts an executor with a hello of a new session, answered by ExecutorReady for it, so a
restarted scheduler takes over the running executor. An executor that starts sends an unasked
ExecutorReady; a running scheduler that sees one, or cannot reach its executor, has lost it:
it ends every request with an error, drops its state and adopts the new one.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import zmq

from services.scheduler.engine_core import EngineCore
from services.scheduler.handshake import check_protocol, refuse_other_versions, scheduler_config
from services.scheduler.kv_events import KvEventPublisher
from services.scheduler.lora_control import LoraControl
from services.scheduler.lora_registry import LoraRegistry, clock_id
from services.scheduler.request_owners import RequestOwners
from services.scheduler.scheduler import Scheduler
from services.scheduler.stats_log import StatsLog
from shared.config import Config
from shared.constants import STATS_INTERVAL_S, STATS_LOG_INTERVAL_S
from shared.frontend_links import FrontendLinks, HeartbeatThread
from shared.gc_heap import freeze_startup_heap
from shared.ipc import Decoder, bind_router, encode, routed
from shared.lora_modules import parse_lora_modules
from shared.protocol import (
    AbortRequests,
    AddLoraAdapter,
    DeviceReady,
    EngineRequest,
    ErrorKind,
    ExecutorReady,
    LaunchStep,
    LoraAdapterAdded,
    LoraAdapterRequest,
    LoraAdapterResult,
    ModelRunnerOutput,
    OutputBatch,
    RequestError,
    RequestOutput,
    SchedulerHello,
    SchedulerOutput,
    ToScheduler,
)
from shared.replicas import engine_component
from shared.stall_watch import StallWatch
from shared.wire_security import WireSecurity

logger = logging.getLogger(__name__)
Handler = Callable[[bytes, object], None]
EXECUTOR_IDENTITY = b"executor-0"  # the executor's DEALER identity (services/executor/process.py)
HELLO_INTERVAL_S = 1.0


EXECUTOR_MESSAGES = (ExecutorReady, ModelRunnerOutput, DeviceReady, LoraAdapterAdded)


def _drop(identity: bytes, message: object) -> None:
    logger.warning("dropped a %s from %r", type(message).__name__, identity[:64])


class ExecutorLost(RuntimeError):
    """The executor this scheduler ran steps on is gone: restarted, or unreachable."""


class Inbox:
    """What reaches the scheduler's ROUTER, decoded; a malformed frame is logged and dropped."""

    def __init__(self, router: zmq.Socket[Any]) -> None:
        self.router = router
        self.decoder = Decoder(ToScheduler, "scheduler")

    def receive(self, timeout_ms: int) -> tuple[bytes, object | None, bytes] | None:
        """(sender, message or None if malformed, raw frame); None if nothing came in time."""
        if not self.router.poll(timeout_ms):
            return None
        frames = self.router.recv_multipart()
        received = routed(frames)
        if received is None:
            return frames[0], None, b""  # dropped (logged); callers go on reading
        identity, frame = received
        return identity, self.decoder.decode(frame), frame


class RemoteExecutor:
    """The executor process, as an `Executor`: plans go out through the ROUTER, and `collect`
    waits in the inbox for the oldest plan's answer.

    A plan is launched when the executor's device is ready for it (DeviceReady answered by
    LaunchStep); until then it is held and takes addenda. While `collect` waits, whatever else
    arrives (requests, aborts) goes to `handle`, and `tick` runs after each batch of messages,
    so a long step neither stalls intake nor looks like a hang. NOTE: an abort handled here
    frees blocks that steps in flight may still write; that is safe because any later step
    that reuses them runs after those on the executor's device queue.
    """

    def __init__(
        self,
        router: zmq.Socket[Any],
        inbox: Inbox,
        handle: Handler,
        tick: Callable[[], None],
        timeout: float,
        lora_added: Callable[[LoraAdapterAdded], None],
    ) -> None:
        self.router, self.inbox, self.handle, self.tick = router, inbox, handle, tick
        self.lora_added = lora_added
        self.timeout = timeout
        self.session = 0  # of the last hello; answered by the executor being adopted
        self.identity: bytes | None = None
        self._submitted: deque[int] = deque()  # steps sent, not yet collected
        self._answers: dict[int, ModelRunnerOutput] = {}  # answered, not yet collected
        self._held: int | None = None  # the step sent and not launched yet
        self._device_ready = False  # DeviceReady came while no plan was held

    def adopt(self) -> ExecutorReady:
        """Say hello (a new session) until the executor answers; its report. Requests that
        come meanwhile are handled (and refused); so is the unasked report of an executor
        that just started, which only makes the next hello go out at once."""
        self.session = random.getrandbits(62)
        self.identity = None
        self._submitted.clear()
        self._answers.clear()
        self._held, self._device_ready = None, False
        next_hello = 0.0
        while True:
            if time.monotonic() >= next_hello:
                self._hello()
                next_hello = time.monotonic() + HELLO_INTERVAL_S
            received = self.inbox.receive(100)
            if received is None:
                continue
            identity, message, frame = received
            if isinstance(message, EXECUTOR_MESSAGES) and identity != EXECUTOR_IDENTITY:
                _drop(identity, message)
            elif isinstance(message, ExecutorReady):
                check_protocol(message.protocol_version)
                if message.session == self.session:
                    self.identity = identity
                    return message
                next_hello = 0.0  # an executor that just started: greet it now
            elif message is None and identity == EXECUTOR_IDENTITY:
                refuse_other_versions(frame)
            elif not isinstance(message, EXECUTOR_MESSAGES):  # not the last session's answers
                self.handle(identity, message)

    def _hello(self) -> None:
        # ROUTER_MANDATORY: an executor not connected yet raises; the next hello will do.
        with contextlib.suppress(zmq.ZMQError):
            self.router.send_multipart([EXECUTOR_IDENTITY, encode(SchedulerHello(self.session))])

    def submit(self, plan: SchedulerOutput) -> None:
        if self._held is not None:
            # The executor asks to launch a step before it answers the step before it.
            raise RuntimeError(f"plan {plan.step} while plan {self._held} is not launched")
        self._send(plan)
        self._submitted.append(plan.step)
        self._held = plan.step
        self._launch_if_ready()

    def accepts_addendum(self, step: int) -> bool:
        return self._held == step

    def amend(self, addendum: SchedulerOutput) -> None:
        self._send(addendum)

    def take(self, identity: bytes, message: object) -> bool:
        """Keep the executor's messages (answers, DeviceReady), wherever they are received:
        the executor answers a step as soon as it ends, `collect` or not. Such messages from
        anyone but the adopted executor are dropped."""
        if isinstance(message, EXECUTOR_MESSAGES) and identity != self.identity:
            _drop(identity, message)
            return True
        if isinstance(message, ModelRunnerOutput):
            self._answers[message.step] = message
        elif isinstance(message, DeviceReady):
            self._device_ready = True
            self._launch_if_ready()
        elif isinstance(message, LoraAdapterAdded):
            self.lora_added(message)
        elif isinstance(message, ExecutorReady):
            if message.session != self.session:  # unasked: a new executor process started
                raise ExecutorLost("the executor restarted")
            # else: the answer to a repeated hello of this session, already adopted
        else:
            return False
        return True

    def collect(self) -> ModelRunnerOutput:
        step = self._submitted.popleft()
        deadline = time.monotonic() + self.timeout
        while step not in self._answers:
            if time.monotonic() > deadline:
                raise ExecutorLost(f"the executor did not answer step {step} in {self.timeout} s")
            self.tick()
            received = self.inbox.receive(500)
            while received is not None:  # all that came in, before the next tick
                identity, message, _ = received
                if message is not None and not self.take(identity, message):
                    self.handle(identity, message)
                if step in self._answers:
                    break
                received = self.inbox.receive(0)
        return self._answers.pop(step)

    def _launch_if_ready(self) -> None:
        if self._device_ready and self._held is not None:
            self._send(LaunchStep(self._held))
            self._held = None
            self._device_ready = False

    def add_lora(self, message: AddLoraAdapter) -> None:
        """Ask the executor to take an adapter; it answers with LoraAdapterAdded."""
        self._send(message)

    def _send(self, message: SchedulerOutput | LaunchStep | AddLoraAdapter) -> None:
        if self.identity is None:
            raise RuntimeError("a plan before the executor reported ready")
        try:
            self.router.send_multipart([self.identity, encode(message)])
        except zmq.ZMQError as exc:  # its connection closed: the process is gone
            raise ExecutorLost(f"the executor is unreachable ({exc})") from exc


class SchedulerProcess:
    def __init__(self, config: Config) -> None:
        address = config.replica_address("scheduler_address")
        if address is None or config.frontend_address is None:
            raise ValueError("the scheduler needs --scheduler-address and --frontend-address")
        self.config, self.address = config, address
        self.name = engine_component("scheduler", config)
        context: zmq.Context[Any] = zmq.Context.instance()
        security = WireSecurity.of(config)
        self.router = bind_router(context, address, security)
        self.frontends = FrontendLinks(
            context, config.frontend_address, self.name, security=security
        )
        self.inbox = Inbox(self.router)
        self.loras = LoraControl(
            LoraRegistry(parse_lora_modules(config.lora_modules), first_runtime_id=clock_id()),
            config.allow_runtime_lora_updating,
            config.replica,
            self._answer_lora,
        )
        # A backstop: the executor ends a stalled step itself (its StallWatch), unless it is
        # stuck so hard that its heartbeat thread stopped too.
        backstop = config.engine_stall_timeout + 2 * config.component_timeout
        self.executor = RemoteExecutor(
            self.router, self.inbox, self._handle, self._tick, backstop, self.loras.added
        )
        self.kv_events = None
        events_address = config.replica_address("kv_events_address")
        if events_address is not None:
            self.kv_events = KvEventPublisher(context, events_address, config.replica, security)
        self.owners = RequestOwners()
        self.core: EngineCore | None = None
        self.stats_log = None if config.disable_log_stats else StatsLog(STATS_LOG_INTERVAL_S)
        self._last_stats = 0.0
        self._said_full = False  # the last snapshot sent said the waiting queue was full
        self.watch = StallWatch(config.engine_stall_timeout)
        self._heartbeat = HeartbeatThread(
            config.frontend_address, self.name, stall_watch=self.watch, security=security
        )

    def run(self) -> None:
        first = True
        while True:
            core = self._start_engine()
            if first:  # once: a collection after an executor came back would finalize the
                freeze_startup_heap()  # old engine's sockets mid-loop (seen to hang it)
                first = False
            try:
                self._serve(core)
            except ExecutorLost as lost:
                logger.error(
                    "%s: ending %d requests with an error, waiting for an executor",
                    lost,
                    len(self.owners),
                )
                self.core = None
                self._fail_all(core, f"{lost}; the request was lost")

    def _start_engine(self) -> EngineCore:
        ready = self.executor.adopt()
        if self.stats_log is not None:  # a new engine counts from zero: rates start over
            self.stats_log = StatsLog(STATS_LOG_INTERVAL_S)
        core = self.core = EngineCore(
            Scheduler(scheduler_config(self.config, ready)), self.executor
        )
        self.loras.adopt(core.scheduler, ready.model_name)
        if self.kv_events is not None:
            self.kv_events.new_engine()
        logger.info(
            "scheduler ready: %s, %d KV blocks of %d tokens, max_model_len=%d, bound at %s",
            ready.model_name,
            ready.num_blocks,
            ready.block_size,
            ready.max_model_len,
            self.address,
        )
        return core

    def _serve(self, core: EngineCore) -> None:
        while True:
            self.watch.working("a turn of the scheduler loop")
            received = self.inbox.receive(0 if core.has_unfinished() else 50)
            while received is not None:
                identity, message, _ = received
                if message is not None and not self.executor.take(identity, message):
                    self._handle(identity, message)
                received = self.inbox.receive(0)
            core.amend()
            if core.has_unfinished():
                self._publish(core.step())
            self._report_stats()
            if self.kv_events is not None:
                self.kv_events.publish(core.scheduler, self.owners.counts)

    def _fail_all(self, core: EngineCore, reason: str) -> None:
        """End every request the lost engine held with an UNAVAILABLE error, each once."""
        error = RequestError.unavailable(reason)
        requests, outputs = core.scheduler.requests, []
        for request_id in self.owners:
            request = requests.get(request_id)
            prompt_len = request.num_prompt_tokens if request else 0
            outputs.append(RequestOutput.failure(request_id, error, prompt_len))
        self._publish(outputs)  # finished outputs: their owners go too

    def _tick(self) -> None:
        """Between batches of messages while a step runs: new requests join the held plan."""
        self.watch.working("a turn of the scheduler loop")
        if self.core is not None:
            self.core.amend()
        self._report_stats()

    def _handle(self, identity: bytes, message: object) -> None:
        """A message for the scheduler itself (the executor's go to `RemoteExecutor.take`)."""
        if isinstance(message, EngineRequest):
            self._add(identity, message)
        elif isinstance(message, AbortRequests):
            self._publish(self.core.abort(message.request_ids) if self.core else [])
        elif isinstance(message, LoraAdapterRequest):
            scheduler = self.core.scheduler if self.core is not None else None
            self.loras.request(identity, message, scheduler, self.executor.add_lora)
        else:
            logger.warning("unexpected %s from %r", type(message).__name__, identity)

    def _add(self, identity: bytes, request: EngineRequest) -> None:
        error = self._admit(request)
        if error is None:
            # Only now: a refused duplicate id must not take over the original's owner.
            self.owners.add(request.request_id, identity)
            return
        refusal = RequestOutput.failure(request.request_id, error, len(request.prompt_token_ids))
        self._send_outputs(identity, [refusal])
        if error.kind is ErrorKind.QUEUE_FULL and not self._said_full:
            self._report_stats(now=True)  # frontends refuse up front from now on

    def _admit(self, request: EngineRequest) -> RequestError | None:
        if self.core is None:
            return RequestError.unavailable("the engine is still starting")
        try:
            self.core.add_request(request)
        except Exception as exc:
            error = RequestError.of(exc)
            if error.kind is ErrorKind.INTERNAL:
                logger.exception("request_id=%s could not be added", request.request_id)
            return error
        return None

    def _answer_lora(self, owner: bytes, result: LoraAdapterResult) -> None:
        """Back through the tokenizer worker the request came by; every frontend hears of the
        change from the next snapshot, sent now."""
        with contextlib.suppress(zmq.ZMQError):  # its worker is gone: so is the caller
            self.router.send_multipart([owner, encode(result)], flags=zmq.DONTWAIT)
        self._report_stats(now=True)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        by_owner: dict[bytes, list[RequestOutput]] = defaultdict(list)
        for output in outputs:
            owner = self.owners.get(output.request_id)
            if owner is None:
                continue
            by_owner[owner].append(output)
            if output.finished:
                self.owners.pop(output.request_id)
        for owner, batch in by_owner.items():
            self._send_outputs(owner, batch)

    def _send_outputs(self, owner: bytes, batch: list[RequestOutput]) -> None:
        try:
            self.router.send_multipart([owner, encode(OutputBatch(batch))], flags=zmq.DONTWAIT)
        except zmq.ZMQError as exc:
            # The worker is gone or not reading: nobody will read these requests' outputs,
            # so stop them rather than let them hold KV blocks (the frontend fails them).
            logger.error("cannot reach tokenizer worker %r (%s): aborting its requests", owner, exc)
            lost = [o.request_id for o in batch if not o.finished]
            if self.core is not None:
                self.core.abort(lost)
            for request_id in lost:
                self.owners.pop(request_id)

    def _report_stats(self, now: bool = False) -> None:
        """A snapshot to every frontend every STATS_INTERVAL_S (or `now`), and the stats log
        line."""
        at = time.monotonic()
        if self.core is None or (at - self._last_stats < STATS_INTERVAL_S and not now):
            return
        self._last_stats = at
        snapshot = self.core.stats()
        snapshot.replica = self.config.replica
        snapshot.lora_adapters = self.loras.registry.listing()
        snapshot.lora_version = self.loras.registry.version
        self._said_full = snapshot.queue_full is not None
        self.frontends.refresh()
        self.frontends.send_all(encode(snapshot))  # one missed is replaced by the next
        line = self.stats_log.line(at, snapshot) if self.stats_log else None
        if line is not None:
            logger.info("%s", line)
