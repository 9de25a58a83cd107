"""A tokenizer worker process: the worker core between DEALERs to every frontend (each request
is answered on the link it came from) and a DEALER to each engine replica's scheduler (one
with --data-parallel-size 1); each request goes to the replica the router picks from the
replicas' KV events (services/tokenizer/replica_router.py), and each LoRA load or unload to
every replica (services/tokenizer/lora_fanout.py)."""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from socket import gethostname
from typing import Any

import msgspec
import zmq

from services.tokenizer.handover import HandoverLegs
from services.tokenizer.lora_fanout import LoraFanout
from services.tokenizer.owed_endings import OwedEndings
from services.tokenizer.replica_router import ReplicaRouter
from services.tokenizer.worker import TokenizerWorker
from shared.config import Config
from shared.constants import HEARTBEAT_INTERVAL_S
from shared.frontend_links import FrontendLinks, HeartbeatThread
from shared.gc_heap import freeze_startup_heap
from shared.hf_tokenizer import load_tokenizer
from shared.ipc import Decoder, connect_dealer, encode, subscribe
from shared.model_config import resolve_model_source
from shared.protocol import (
    AbortRequests,
    EngineRequest,
    FrontendToTokenizer,
    GenerateRequest,
    KvEventBatch,
    LoraAdapterRequest,
    LoraAdapterResult,
    OutputBatch,
    ParameterError,
    ReplicasDown,
    RequestError,
    RequestOutput,
    SchedulerToTokenizer,
    TextDelta,
    TextDeltas,
    TokenizeRequest,
    TokenizeResult,
)
from shared.wire_security import WireSecurity

logger = logging.getLogger(__name__)
POLL_MS = 200  # how often a draining worker checks whether it is done
DRAIN_NOTICE_BEATS = 3  # heartbeats a draining worker waits for, so every frontend knows


def worker_name(index: int | None) -> str:
    """The worker's ZeroMQ identity, unique in the pool: the frontend and the scheduler send
    its requests' traffic to it by name."""
    if index is not None:
        return f"tokenizer-{index}"
    return f"tokenizer-{gethostname()}-{os.getpid()}"


class TokenizerProcess:
    def __init__(self, config: Config) -> None:
        if config.scheduler_address is None or config.frontend_address is None:
            raise ValueError("a tokenizer worker needs --scheduler-address and --frontend-address")
        self.name = worker_name(config.worker_index)
        if config.ready_file is not None:  # one left by a previous process is not true now
            Path(config.ready_file).unlink(missing_ok=True)
        source = resolve_model_source(config.model)
        tokenizer = load_tokenizer(source, config.tokenizer, config.cache_dir)
        if tokenizer is None:
            raise ValueError(f"{source.name} ships no tokenizer; pass --tokenizer")
        self.worker = TokenizerWorker(
            tokenizer,
            grammar_timeout_s=config.grammar_compile_timeout,
            lenient_json=not config.disable_additional_properties,
            tool_call_parser=config.tool_call_parser if config.enable_auto_tool_choice else None,
            reasoning_parser=config.reasoning_parser,
        )
        self.worker.start_grammar_tokenizer()
        context: zmq.Context[Any] = zmq.Context.instance()
        security = WireSecurity.of(config)
        self.frontends = FrontendLinks(
            context, config.frontend_address, self.name, security=security
        )
        self.origin: dict[str, zmq.Socket[Any]] = {}  # request_id -> the frontend that sent it
        self.owed = OwedEndings(self.name)  # endings for frontends whose link was full
        # One scheduler per engine replica; each request goes to one (the router's pick)
        self.schedulers = [
            connect_dealer(context, address, self.name, security)
            for address in config.addresses("scheduler_address")
        ]
        self.router = ReplicaRouter(
            len(self.schedulers), config.data_parallel_routing == "prefix", self.name
        )
        self.placed: dict[str, int] = {}  # request_id -> its replica
        self.down: dict[int, str] = {}  # replicas the frontend says are down, and why
        self.legs = HandoverLegs(config.prefill_replicas, len(self.schedulers))
        self.lora_fanout = LoraFanout(len(self.schedulers), self._to_replica, self._answer_lora)
        events = config.addresses("kv_events_address")
        self.kv_events = [subscribe(context, address, security) for address in events]
        if len(self.schedulers) > 1 and not events and self.router.by_prefix:
            logger.warning(
                "%s: no --kv-events-address: requests go to the replica with fewest of this "
                "worker's unfinished requests, not by prefix or the replicas' whole load",
                self.name,
            )
        self.poller = zmq.Poller()
        self.drain_timeout = config.drain_timeout
        self.draining = threading.Event()
        self.drain_started = float("inf")
        self.ready_file = config.ready_file
        self.heartbeat = HeartbeatThread(
            config.frontend_address, self.name, self.draining, security=security
        )

    def _on_signal(self, signum: int, _frame: object) -> None:
        """First SIGTERM/SIGINT: take no new requests (the heartbeat says so), finish the
        running ones within --drain-timeout, then exit. A second: exit now."""
        if self.draining.is_set():
            raise SystemExit(1)
        self.drain_started = time.monotonic()
        self.draining.set()  # the loop logs it: no logging inside a signal handler

    def run(self) -> None:
        freeze_startup_heap()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        from_frontend = Decoder(FrontendToTokenizer, f"{self.name} (frontend)")
        from_scheduler = Decoder(SchedulerToTokenizer, f"{self.name} (scheduler)")
        kv_events = Decoder(KvEventBatch, f"{self.name} (KV events)")
        for socket in (*self.schedulers, *self.kv_events):
            self.poller.register(socket, zmq.POLLIN)
        for link in self.frontends.sockets.values():
            self.poller.register(link, zmq.POLLIN)
        if self.ready_file is not None:
            Path(self.ready_file).touch()
        logger.info("%s ready", self.name)
        said_draining = False
        try:
            while not self._drained():
                for socket in dict(self.poller.poll(timeout=POLL_MS)):
                    if socket in self.schedulers:
                        replica = self.schedulers.index(socket)
                        handler = functools.partial(self._from_scheduler, replica)
                        self._guarded(handler, from_scheduler, socket.recv())
                    elif socket in self.kv_events:
                        self._guarded(self._kv_events, kv_events, socket.recv())
                    else:
                        handler = functools.partial(self._from_frontend, socket)
                        self._guarded(handler, from_frontend, socket.recv())
                self.owed.flush()
                self.lora_fanout.expire(time.monotonic())
                self._refresh_frontends()
                if self.draining.is_set() and not said_draining:
                    logger.info("%s: draining %d requests", self.name, len(self.worker.live))
                    said_draining = True
            if self.worker.live:  # the drain timeout
                self._cut(sorted(self.worker.live))
            logger.info("%s drained: exiting", self.name)
        finally:
            self._close()

    def _close(self) -> None:
        """Let the last replies out: every socket closes with a linger, then the context
        ends, which is when a linger is honoured."""
        self.heartbeat.stop()
        self.frontends.close(linger_ms=1000)
        for socket in (*self.schedulers, *self.kv_events):
            socket.close(linger=1000)
        zmq.Context.instance().term()

    def _refresh_frontends(self) -> None:
        """Link to frontends that appeared; stop the requests of those that went (their
        clients went with them)."""
        added, removed = self.frontends.refresh()
        for link in added:
            self.poller.register(link, zmq.POLLIN)
        for link in removed:
            self.poller.unregister(link)
            self.owed.forget(link)
        orphan_ids = sorted(r for r, link in self.origin.items() if link in removed)
        if orphan_ids:
            logger.warning("%s: a frontend went: stopping %s", self.name, orphan_ids)
            self._stop(orphan_ids)

    def _stop(self, request_ids: list[str]) -> None:
        self.worker.abort(request_ids)
        for request_id in request_ids:
            self.origin.pop(request_id, None)
            self.legs.forget(request_id)
        self._abort(request_ids)

    def _abort(self, request_ids: list[str]) -> None:
        """Tell each request's replica to stop it; one placed by no worker here, every one."""
        by_replica: dict[int, list[str]] = defaultdict(list)
        for request_id in request_ids:
            replica = self._unplace(request_id)
            for r in range(len(self.schedulers)) if replica is None else (replica,):
                by_replica[r].append(request_id)
        for replica, ids in by_replica.items():
            self.schedulers[replica].send(encode(AbortRequests(ids)))

    def _drained(self) -> bool:
        """Draining, and done: nothing left or out of time. Never before every frontend has
        heard that this worker drains (a few heartbeats), so none sends it a request it
        would not read."""
        if not self.draining.is_set():
            return False
        elapsed = time.monotonic() - self.drain_started
        if elapsed < DRAIN_NOTICE_BEATS * HEARTBEAT_INTERVAL_S:
            return False
        # Owed endings too: a frontend still waits for them; and a LoRA change half done
        # would leave its name taken on replica 0.
        done = not self.worker.live and not len(self.owed) and not self.lora_fanout.changes
        return done or elapsed >= self.drain_timeout

    def _cut(self, request_ids: list[str]) -> None:
        """The drain timeout: end what is left with an error here, rather than leave the
        frontend to notice this worker's silence."""
        logger.warning("%s: drain timeout, cutting %s", self.name, request_ids)
        error = RequestError.unavailable(f"{self.name} stopped (drain timeout)")
        for request_id in request_ids:
            self._reply(request_id, TextDelta.failure(request_id, error))
        self._stop(request_ids)

    def _guarded(self, handler: Callable[[object], None], decoder: Decoder, frame: bytes) -> None:
        # One frame's failure is logged; it must never take the worker (and the server) down.
        # Decoding is inside: msgspec raises more than DecodeError for some frames (a string
        # that is not UTF-8, maps nested a thousand deep), and a peer can send any bytes.
        message: object | None = None
        try:
            message = decoder.decode(frame)
            if message is not None:
                handler(message)
        except Exception:
            what = f"frame of {len(frame)} bytes" if message is None else type(message).__name__
            logger.exception("%s failed to handle a %s", self.name, what)

    def _reply(
        self, request_id: str, message: TextDelta | TokenizeResult | LoraAdapterResult
    ) -> None:
        """To the frontend the request came from; ends its link when the request ends."""
        ends = not isinstance(message, TextDelta) or message.finish_reason is not None
        link = self.origin.pop(request_id, None) if ends else self.origin.get(request_id)
        if link is None:
            return
        try:
            link.send(encode(message), flags=zmq.DONTWAIT)
        except zmq.Again:  # that frontend stopped reading: never let it stall the others
            if isinstance(message, TextDelta):
                logger.warning(
                    "request_id=%s: its frontend is not reading: stopping it", request_id
                )
                self._fell_behind(link, [request_id])
            else:  # an answer (tokenize, LoRA): the frontend's wait for it times out
                logger.warning("request_id=%s: its frontend is not reading", request_id)

    def _reply_deltas(self, deltas: list[TextDelta]) -> None:
        """A step's deltas: one TextDeltas message to each frontend they go to."""
        by_link: dict[zmq.Socket[Any], list[TextDelta]] = defaultdict(list)
        for delta in deltas:
            ends = delta.finish_reason is not None
            rid = delta.request_id
            link = self.origin.pop(rid, None) if ends else self.origin.get(rid)
            if link is not None:
                by_link[link].append(delta)
        for link, batch in by_link.items():
            try:
                link.send(encode(TextDeltas(batch)), flags=zmq.DONTWAIT)
            except zmq.Again:  # that frontend stopped reading: never let it stall the others
                logger.warning("a frontend is not reading: stopping its %d requests", len(batch))
                self._fell_behind(link, [d.request_id for d in batch])

    def _fell_behind(self, link: zmq.Socket[Any], request_ids: list[str]) -> None:
        """Stop requests whose replies did not fit their frontend's link; each one's error
        ending goes once the link takes it."""
        self._stop(request_ids)
        self.owed.owe(link, request_ids)

    def _from_frontend(self, link: zmq.Socket[Any], message: object) -> None:
        if isinstance(message, GenerateRequest | TokenizeRequest | LoraAdapterRequest):
            self.origin[message.request_id] = link
        if isinstance(message, GenerateRequest):
            try:
                admitted = self.worker.admit(message)
            except Exception as exc:  # the client's (ParameterError, 400) or ours (500)
                if not isinstance(exc, ParameterError):
                    logger.exception("request_id=%s could not be tokenized", message.request_id)
                self.worker.abort([message.request_id])
                failure = TextDelta.failure(message.request_id, RequestError.of(exc))
                self._reply(message.request_id, failure)
                return
            self._send(*self.legs.first_leg(admitted))
        elif isinstance(message, TokenizeRequest):
            self._reply(message.request_id, self.worker.tokenize(message))
        elif isinstance(message, AbortRequests):
            self._stop(message.request_ids)
        elif isinstance(message, LoraAdapterRequest):  # every replica's scheduler's to answer
            self.lora_fanout.start(message, time.monotonic())
        elif isinstance(message, ReplicasDown):
            self._replicas_down(message.replicas)

    def _send(self, request: EngineRequest, among: Sequence[int] | None) -> None:
        """To the replica the router picks (of `among`), of those not down."""
        if self.down:
            among = [r for r in among or range(len(self.schedulers)) if r not in self.down]
            if not among:
                why = "; ".join(f"replica {r}: {why}" for r, why in sorted(self.down.items()))
                self._fail([request.request_id], f"no engine replica can take it ({why})")
                return
        token_ids = request.prompt_token_ids + request.output_token_ids
        replica = self.router.pick(token_ids, request.lora_id, among)
        self.placed[request.request_id] = replica
        self.schedulers[replica].send(encode(request))

    def _to_replica(self, replica: int, request: LoraAdapterRequest) -> None:
        self.schedulers[replica].send(encode(request))

    def _answer_lora(self, result: LoraAdapterResult) -> None:
        self._reply(result.request_id, result)

    def _kv_events(self, batch: object) -> None:
        if isinstance(batch, KvEventBatch):
            self.router.observe(batch)

    def _from_scheduler(self, replica: int, batch: object) -> None:
        if isinstance(batch, LoraAdapterResult):
            self.lora_fanout.on_result(replica, batch)
            return
        if not isinstance(batch, OutputBatch):
            return
        outputs = batch.outputs
        if any(output.handed_over for output in outputs):  # the request goes on elsewhere
            outputs = [_going_on(output) for output in outputs]
        deltas, ended = self.worker.on_outputs(outputs)
        self._reply_deltas(deltas)
        if ended:  # ended here (a stop string): the scheduler stops them too
            self._abort(ended)
        for output in batch.outputs:
            if output.handed_over:
                self._hand_over(replica, output)
            elif output.finished:
                self._unplace(output.request_id)
                self.legs.forget(output.request_id)

    def _hand_over(self, replica: int, output: RequestOutput) -> None:
        """A prefill replica computed the request's prompt: on to a decode replica, unless it
        ended here meanwhile."""
        self._unplace(output.request_id)
        if output.request_id not in self.worker.live:
            self.legs.forget(output.request_id)
            return
        request = self.legs.second_leg(output, replica)
        if request is not None:
            self._send(request, self.legs.decode)

    def _replicas_down(self, down: dict[int, str]) -> None:
        """The frontend's word on which replicas are down: the requests placed on one newly
        down end with an error (its scheduler cannot end them); none is placed there while
        it is down. With one replica the frontend ends every request itself and never says."""
        if len(self.schedulers) == 1:
            return
        down = {r: why for r, why in down.items() if 0 <= r < len(self.schedulers)}
        newly = {r: why for r, why in down.items() if r not in self.down}
        self.down = dict(down)
        for replica, why in sorted(newly.items()):
            lost = sorted(rid for rid, placed in self.placed.items() if placed == replica)
            logger.warning("%s: engine replica %d is down (%s)", self.name, replica, why)
            self._fail(lost, f"engine replica {replica} is down: {why}")

    def _fail(self, request_ids: list[str], why: str) -> None:
        """End requests with an UNAVAILABLE error here, without a word to their replica."""
        for request_id in request_ids:
            self._reply(request_id, TextDelta.failure(request_id, RequestError.unavailable(why)))
            self._unplace(request_id)
            self.legs.forget(request_id)
        self.worker.abort(request_ids)

    def _unplace(self, request_id: str) -> int | None:
        """Forget where a request that ended went (None: not placed by this worker)."""
        replica = self.placed.pop(request_id, None)
        if replica is not None:
            self.router.release(replica)
        return replica


def _going_on(output: RequestOutput) -> RequestOutput:
    """A handed-over output as the worker reads it: its request has not ended."""
    if not output.handed_over:
        return output
    return msgspec.structs.replace(output, finish_reason=None)
