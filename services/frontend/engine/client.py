"""The frontend's view of the engine: one ROUTER socket, one asyncio queue per live request,
the pool of tokenizer workers, and the health of every component (heartbeats, the connections
they come on, the launcher's ComponentDown notices)."""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import AsyncGenerator

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from services.frontend.engine.health import engine_failure, starting_reason, tokenizer_pool_reason
from services.frontend.engine.liveness import Liveness
from services.frontend.engine.lora_listings import LoraListings
from services.frontend.engine.replica_faults import ReplicaFaults
from services.frontend.engine.tokenizer_pool import TokenizerPool
from shared.config import Config
from shared.constants import LORA_ANSWER_MARGIN_S, LORA_LOAD_TIMEOUT_S, TOKENIZE_TIMEOUT_S
from shared.ipc import Decoder, bind_router, encode, routed, terminate
from shared.lora_modules import parse_lora_modules
from shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequests,
    ComponentDown,
    GenerateRequest,
    Heartbeat,
    LoraAdapterInfo,
    LoraAdapterListing,
    LoraAdapterRequest,
    LoraAdapterResult,
    ReplicasDown,
    RequestError,
    StatsSnapshot,
    TextDelta,
    TextDeltas,
    ToFrontend,
    TokenizeRequest,
    TokenizeResult,
)
from shared.replicas import engine_components, replica_name
from shared.wire_security import WireSecurity

logger = logging.getLogger(__name__)
WATCHDOG_INTERVAL_S = 0.25


class EngineUnavailable(RuntimeError):
    """The engine is dead, still starting, or draining."""


class QueueFull(RuntimeError):
    """The engine's waiting queue is full (as its last snapshot said): retry later."""


class RequestTimeout(RuntimeError):
    """A call ran past its deadline (--request-timeout or the body's `timeout`)."""


class Idle:
    """No delta came for `idle_after` seconds: a streaming caller sends a keep-alive."""


IDLE = Idle()


class EngineClient:
    def __init__(self, config: Config) -> None:
        if config.frontend_address is None:
            raise ValueError("the frontend needs --frontend-address")
        if "," in config.frontend_address:
            raise ValueError(
                "a frontend binds one --frontend-address; the list form is for the components"
                " that connect to several frontends"
            )
        self.config = config
        self.context = zmq.asyncio.Context()
        self.socket = bind_router(self.context, config.frontend_address, WireSecurity.of(config))
        # Which of the ROUTER's connections close: a component's closing is the first word
        # that its process is gone (the kernel closes a dead process's sockets at once).
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.decoder = Decoder(ToFrontend, "frontend")
        self.queues: dict[str, asyncio.Queue[TextDelta]] = {}
        # Requests answered by one message: /tokenize (TokenizeResult), LoRA loads and unloads
        self.waiters: dict[str, asyncio.Future[TokenizeResult | LoraAdapterResult]] = {}
        self.liveness = Liveness(config.component_timeout)  # every component's, workers too
        self.stalled: dict[str, str] = {}  # component -> why its main loop is stuck
        self.expected = engine_components(config)  # each replica's scheduler and executors
        self.tokenizers = TokenizerPool()
        self.down: str | None = None  # why the engine is dead, once it is
        self.faults = ReplicaFaults(config)  # with several replicas: which are down
        # Each engine replica's last StatsSnapshot, and when it came
        self.snapshots: dict[int, StatsSnapshot] = {}
        self.snapshot_at: dict[int, float] = {}
        self.loras = LoraListings(parse_lora_modules(config.lora_modules))
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self._monitor_loop()),
            asyncio.create_task(self._watchdog()),
        ]

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.socket.disable_monitor()
        self.monitor.close()
        self.socket.close()
        terminate(self.context)

    # ---------------------------------------------------------------- health

    @property
    def stats(self) -> StatsSnapshot | None:
        """The first engine replica's last snapshot (what they share: the model's limits), or
        None before any came."""
        return self.snapshots[min(self.snapshots)] if self.snapshots else None

    @property
    def lora_adapters(self) -> dict[str, LoraAdapterInfo]:
        """The LoRA adapters requests may name: those every replica lists."""
        return self.loras.adapters

    @property
    def stats_at(self) -> float | None:
        """When the engine replica heard from longest ago reported; None until every one has."""
        if len(self.snapshot_at) < self.config.data_parallel_size:
            return None
        return min(self.snapshot_at.values())

    def failure_reason(self) -> str | None:
        """Why the engine has failed (a component gone or stuck), or None while it is alive,
        even if still starting or slow: what /health answers."""
        now = time.monotonic()
        gone = [self.liveness.gone(name, now) for name in self.expected]
        return engine_failure(
            now=now,
            timeout=self.config.component_timeout,
            gone=[*self.faults.exited.values(), *(why for why in gone if why is not None)],
            stats_at=self.stats_at,
            down=self.down,
            stalled=self.stalled,
        )

    def unavailable_reason(self) -> str | None:
        """Why a new request cannot be served now, or None: what /ready answers."""
        return self._engine_reason() or tokenizer_pool_reason(
            now=time.monotonic(),
            timeout=self.config.component_timeout,
            num_accepting=len(self.tokenizers.accepting),
            heard_at=self.tokenizers.last_heard,
        )

    def _engine_reason(self) -> str | None:
        """Why the engine cannot serve (starting, a silent, stuck or dead component), or None."""
        return self.failure_reason() or starting_reason(
            expected=self.expected, last_seen=self.liveness.last_seen, stats_at=self.stats_at
        )

    async def _watchdog(self) -> None:
        started, failing = time.monotonic(), False
        while self.down is None:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            now = time.monotonic()
            for name in self.tokenizers.names:
                why = self.liveness.gone(name, now)
                if why is not None:
                    self._worker_left(name, why)
            if self.stats_at is None and time.monotonic() - started < self.config.startup_timeout:
                continue  # still loading: the launcher watches startup
            # The engine's failures end what runs on it; the pool, what a worker held itself.
            reason = self._engine_reason()
            if self.config.data_parallel_size > 1:
                await self._judge_replicas()
            elif reason is not None and not failing:
                self._lost(reason)
            failing = reason is not None  # silence can end: then serve again

    def _failures(self) -> dict[str, str]:
        """Each engine component gone, stuck or silent (a scheduler that stopped reporting),
        and why."""
        now = time.monotonic()
        failures = {name: f"{name} is stalled: {why}" for name, why in self.stalled.items()}
        for name in self.expected:
            if (why := self.liveness.gone(name, now)) is not None:
                failures[name] = why
        for replica, at in self.snapshot_at.items():
            if now - at > self.config.component_timeout:
                name = replica_name("scheduler", replica, self.config.data_parallel_size)
                failures.setdefault(name, f"{name} has stopped reporting")
        return failures

    async def _judge_replicas(self) -> None:
        """With several replicas, each is a failure domain: the tokenizer workers end the
        requests they placed on one that fails, and place none there while it is down."""
        if self.faults.judge(self._failures()):
            if self.faults.down:
                logger.error(
                    "engine replicas down: %s; their requests fail, the others run on",
                    "; ".join(f"{r}: {why}" for r, why in sorted(self.faults.down.items())),
                )
            else:
                logger.info("every engine replica is up again")
        message = encode(ReplicasDown(self.faults.down))
        for name in self.faults.to_tell(self.tokenizers.names):
            try:
                await self.socket.send_multipart([name.encode(), message])
            except zmq.ZMQError as exc:
                self._worker_left(name, f"{name} unreachable: {exc}")

    def _worker_left(self, name: str, why: str) -> None:
        """A tokenizer worker counts as gone (or cannot be reached): the requests it held end
        with an error now, the others run on."""
        draining = self.tokenizers.draining(name)
        lost_ids = self.tokenizers.leave(name)
        self.liveness.forget(name)
        level = logging.INFO if draining and not lost_ids else logging.WARNING
        logger.log(level, "%s left the tokenizer pool: %s", name, why)
        self._fail(lost_ids, why)

    def _mark_down(self, reason: str) -> None:
        """A component is gone for good (its process exited, or it speaks another protocol)."""
        if self.down is None:
            self.down = reason
            self._lost(reason)

    def _lost(self, reason: str) -> None:
        logger.error(
            "engine unavailable: %s; failing %d in-flight requests", reason, len(self.queues)
        )
        self.fail_in_flight(reason)

    def fail_in_flight(self, reason: str) -> None:
        """End every request in flight with an UNAVAILABLE error (the engine is lost, or the
        server stops before they finish); each caller turns it into a 503 or an error event."""
        self._fail([*self.queues, *self.waiters], reason)

    def _fail(self, request_ids: list[str], reason: str) -> None:
        if request_ids:
            logger.warning("failing %d requests: %s", len(request_ids), reason)
        for request_id in request_ids:
            queue = self.queues.get(request_id)
            if queue is not None:
                queue.put_nowait(TextDelta.failure(request_id, RequestError.unavailable(reason)))
            future = self.waiters.get(request_id)
            if future is not None and not future.done():
                future.set_exception(EngineUnavailable(reason))

    # ---------------------------------------------------------------- traffic

    async def _receive_loop(self) -> None:
        while True:
            frames = await self.socket.recv_multipart(copy=False)
            received = routed([frame.bytes for frame in frames])
            if received is None:
                continue
            identity, data = received
            message = self.decoder.decode(data)
            if message is None:
                continue
            connection = _connection(frames[-1]) if isinstance(message, Heartbeat) else None
            for part in message.deltas if isinstance(message, TextDeltas) else [message]:
                self._receive(identity, part, connection)

    async def _monitor_loop(self) -> None:
        while True:
            try:
                event = parse_monitor_message(await self.monitor.recv_multipart())
            except (ValueError, struct.error):  # not an event: never expected
                continue
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.liveness.closed(int(event["value"]), time.monotonic())

    def _receive(self, identity: bytes, message: object, connection: int | None = None) -> None:
        """Take a message from `identity`, which came on `connection` (a descriptor; None:
        unknown or not needed)."""
        if not self._from_its_sender(identity, message):
            logger.warning("dropped a %s from %r", type(message).__name__, identity[:64])
            return
        try:
            self._take(message, connection)
        except Exception:  # one message must never end the loop (and silence the engine)
            logger.exception("could not take a %s from %r", type(message).__name__, identity)

    def _from_its_sender(self, identity: bytes, message: object) -> bool:
        """Whether `message` comes from the socket that sends that kind: a component's beat
        from its heartbeat thread, stats from the scheduler, a death from the launcher, a
        request's text from the worker that holds it. Anything else is a stranger's."""
        if isinstance(message, Heartbeat):
            known = message.component in self.expected or message.component.startswith("tokenizer-")
            return known and identity == f"{message.component}-heartbeat".encode()
        if isinstance(message, StatsSnapshot):
            scheduler = replica_name("scheduler", message.replica, self.config.data_parallel_size)
            return scheduler in self.expected and identity == scheduler.encode()
        if isinstance(message, ComponentDown):
            return identity == b"launcher"
        if isinstance(message, TextDelta | TokenizeResult | LoraAdapterResult):
            return identity == (self.tokenizers.owner(message.request_id) or "").encode()
        return False

    def _take(self, message: object, connection: int | None = None) -> None:
        if isinstance(message, TextDelta):
            queue = self.queues.get(message.request_id)
            if queue is not None:
                queue.put_nowait(message)
        elif isinstance(message, Heartbeat):
            if message.protocol_version != PROTOCOL_VERSION and self.down is None:
                self._mark_down(
                    f"{message.component} speaks protocol "
                    f"{message.protocol_version}, not {PROTOCOL_VERSION}"
                )
            self._heard(message, connection)
        elif isinstance(message, StatsSnapshot):
            self.snapshots[message.replica] = message
            self.snapshot_at[message.replica] = time.monotonic()
            self.loras.take(
                LoraAdapterListing(
                    replica=message.replica,
                    adapters=message.lora_adapters,
                    version=message.lora_version,
                )
            )
        elif isinstance(message, TokenizeResult | LoraAdapterResult):
            if isinstance(message, LoraAdapterResult):
                for listing in message.listings:
                    self.loras.take(listing)
            future = self.waiters.pop(message.request_id, None)
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, ComponentDown) and not self.faults.exit(
            message.component, message.exit_code
        ):  # not a replica's of several: the engine is lost
            self._mark_down(f"{message.component} exited with code {message.exit_code}")

    def _heard(self, beat: Heartbeat, connection: int | None) -> None:
        now = time.monotonic()
        self.liveness.beat(beat.component, now, connection)
        if not beat.component.startswith("tokenizer-"):
            if beat.stalled is None:
                self.stalled.pop(beat.component, None)
            else:
                self.stalled[beat.component] = beat.stalled
        elif lost_ids := self.tokenizers.beat(beat.component, beat.session, now, beat.draining):
            self._fail(lost_ids, f"{beat.component} restarted")

    async def _submit(self, request_id: str, message: msgspec.Struct) -> None:
        """Send a new request to the least-loaded tokenizer worker, which keeps it to the end
        (the engine sends its outputs there); one that cannot be reached leaves the pool."""
        while (name := self.tokenizers.assign(request_id)) is not None:
            try:
                await self.socket.send_multipart([name.encode(), encode(message)])
                return
            except zmq.ZMQError as exc:
                self.tokenizers.release(request_id)  # not sent: not the worker's to lose
                self._worker_left(name, f"{name} unreachable: {exc}")
        raise EngineUnavailable("no tokenizer worker takes requests")

    async def _send(self, request_id: str, message: msgspec.Struct) -> None:
        """Send to the worker holding the request (an abort); for one whose worker is gone,
        to any worker, which passes it on to the scheduler."""
        name = self.tokenizers.owner(request_id) or next(iter(self.tokenizers.names), None)
        if name is None:
            raise EngineUnavailable("no tokenizer worker is alive")
        try:
            await self.socket.send_multipart([name.encode(), encode(message)])
        except zmq.ZMQError as exc:
            raise EngineUnavailable(f"{name} unreachable: {exc}") from exc

    def check_available(self) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise EngineUnavailable(reason)

    def check_queue_room(self) -> None:
        """Refuse a new request before any work is spent on it while the engine's waiting
        queue is full (its last snapshot, at most STATS_INTERVAL_S old, or sent at once when
        the scheduler refuses one); the scheduler still checks each request exactly."""
        reasons = [snapshot.queue_full for snapshot in self.snapshots.values()]
        if reasons and all(reasons):  # with several replicas: every one is full
            raise QueueFull(str(reasons[0]))

    async def generate(
        self,
        requests: list[GenerateRequest],
        deadline: float | None = None,
        idle_after: float | None = None,
    ) -> AsyncGenerator[TextDelta | Idle, None]:
        """Yield the deltas of one API call's sub-requests as they come, until all finish;
        IDLE whenever none came for `idle_after` seconds; RequestTimeout once the event loop's
        clock passes `deadline`.

        Whatever ends the iteration early (a client gone, an error, the deadline) aborts what
        is left. So does an error: it may have been decided here (the engine lost, the drain
        deadline) while the engine still runs the request; for one the engine refused, it is
        a no-op.
        """
        self.check_available()
        queue: asyncio.Queue[TextDelta] = asyncio.Queue()
        unfinished = {r.request_id for r in requests}
        to_abort = set(unfinished)
        for request in requests:
            self.queues[request.request_id] = queue
        try:
            for request in requests:
                await self._submit(request.request_id, request)
            while unfinished:
                delta = await _next_delta(queue, deadline, idle_after)
                if isinstance(delta, Idle):
                    yield delta
                    continue
                if delta.request_id not in unfinished:
                    continue  # ended here already (failed while its worker still ran it)
                if delta.finish_reason is not None:
                    unfinished.discard(delta.request_id)
                    if delta.error is None:
                        to_abort.discard(delta.request_id)
                yield delta
        finally:
            for request in requests:
                self.queues.pop(request.request_id, None)
            try:
                await self._abort(sorted(to_abort))
            finally:
                for request in requests:
                    self.tokenizers.release(request.request_id)

    async def _abort(self, request_ids: list[str]) -> None:
        # One by one: each goes to its own worker, and any of them may be unreachable.
        for request_id in request_ids:
            try:
                await self._send(request_id, AbortRequests([request_id]))
            except EngineUnavailable as exc:
                if self.down is None:  # once the engine is known down, this says nothing new
                    logger.warning("could not abort request_id=%s: %s", request_id, exc)

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResult:
        result = await self._ask(request.request_id, request, TOKENIZE_TIMEOUT_S)
        assert isinstance(result, TokenizeResult)
        return result

    async def lora_adapter(self, request: LoraAdapterRequest) -> LoraAdapterResult:
        """Load or unload a LoRA adapter on every engine replica (a tokenizer worker carries
        it out and answers); the answer's listings are the frontend's from then on."""
        timeout = LORA_LOAD_TIMEOUT_S + LORA_ANSWER_MARGIN_S
        result = await self._ask(request.request_id, request, timeout)
        assert isinstance(result, LoraAdapterResult)
        return result

    async def _ask(
        self, request_id: str, request: TokenizeRequest | LoraAdapterRequest, timeout: float
    ) -> TokenizeResult | LoraAdapterResult:
        """Send a request answered by one message, and wait for that message."""
        self.check_available()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[TokenizeResult | LoraAdapterResult] = loop.create_future()
        self.waiters[request_id] = future
        try:
            await self._submit(request_id, request)
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise EngineUnavailable(f"no answer in {timeout:g} s") from None
        finally:
            self.waiters.pop(request_id, None)
            self.tokenizers.release(request_id)


def _connection(frame: zmq.Frame) -> int | None:
    """The connection a message came on, as the ROUTER's descriptor for it (which its monitor
    names when it closes); None over inproc:// or where libzmq does not say."""
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


async def _next_delta(
    queue: asyncio.Queue[TextDelta], deadline: float | None, idle_after: float | None
) -> TextDelta | Idle:
    """The next delta; IDLE after `idle_after` seconds without one; RequestTimeout past the
    deadline. A delta already queued is taken without arming a timer."""
    if not queue.empty() or (deadline is None and idle_after is None):
        return await queue.get()
    loop = asyncio.get_running_loop()
    wake = None if idle_after is None else loop.time() + idle_after
    at = min(t for t in (deadline, wake) if t is not None)
    try:
        async with asyncio.timeout_at(at):
            return await queue.get()
    except TimeoutError:
        if deadline is not None and loop.time() >= deadline:
            raise RequestTimeout("the request ran past its deadline") from None
        return IDLE
