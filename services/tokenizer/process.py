"""A tokenizer worker process: the worker core between a DEALER to the frontend and a DEALER
to the scheduler."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from socket import gethostname
from typing import Any

import zmq

from services.tokenizer.hf_tokenizer import load_tokenizer
from services.tokenizer.worker import TokenizerWorker
from shared.config import Config
from shared.ipc import Decoder, connect_dealer, encode, start_heartbeat
from shared.model_config import resolve_model_source
from shared.protocol import (
    AbortRequests,
    FrontendToTokenizer,
    GenerateRequest,
    OutputBatch,
    ParameterError,
    RequestError,
    SchedulerToTokenizer,
    TextDelta,
    TokenizeRequest,
)

logger = logging.getLogger(__name__)
POLL_MS = 200  # how often a draining worker checks whether it is done


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
        source = resolve_model_source(config.model)
        tokenizer = load_tokenizer(source, config.tokenizer)
        if tokenizer is None:
            raise ValueError(f"{source.name} ships no tokenizer; pass --tokenizer")
        self.worker = TokenizerWorker(tokenizer)
        context: zmq.Context[Any] = zmq.Context.instance()
        self.frontend = connect_dealer(context, config.frontend_address, self.name)
        self.scheduler = connect_dealer(context, config.scheduler_address, self.name)
        self.drain_timeout = config.drain_timeout
        self.draining = threading.Event()
        self.drain_deadline = float("inf")
        self.heartbeat = start_heartbeat(config.frontend_address, self.name, self.draining)

    def _on_signal(self, signum: int, _frame: object) -> None:
        """First SIGTERM/SIGINT: take no new requests (the heartbeat says so), finish the
        running ones within --drain-timeout, then exit. A second: exit now."""
        if self.draining.is_set():
            raise SystemExit(1)
        logger.info(
            "%s: %s, draining %d requests",
            self.name,
            signal.Signals(signum).name,
            len(self.worker.live),
        )
        self.draining.set()
        self.drain_deadline = time.monotonic() + self.drain_timeout

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        logger.info("%s ready", self.name)
        name = self.name
        inbound: dict[zmq.Socket[Any], tuple[Decoder, Callable[[object], None]]] = {
            self.frontend: (
                Decoder(FrontendToTokenizer, f"{name} (frontend)"),
                self._from_frontend,
            ),
            self.scheduler: (
                Decoder(SchedulerToTokenizer, f"{name} (scheduler)"),
                self._from_scheduler,
            ),
        }
        poller = zmq.Poller()
        for socket in inbound:
            poller.register(socket, zmq.POLLIN)
        try:
            while not self._drained():
                for socket in dict(poller.poll(timeout=POLL_MS)):
                    decoder, handler = inbound[socket]
                    message = decoder.decode(socket.recv())
                    if message is not None:
                        self._guarded(handler, message)
            logger.info("%s drained: exiting", self.name)
        finally:
            self.heartbeat.set()

    def _drained(self) -> bool:
        if not self.draining.is_set():
            return False
        if self.worker.live and time.monotonic() < self.drain_deadline:
            return False
        if self.worker.live:
            self._cut(sorted(self.worker.live))
        return True

    def _cut(self, request_ids: list[str]) -> None:
        """The drain timeout: end what is left with an error here, rather than leave the
        frontend to notice this worker's silence."""
        logger.warning("%s: drain timeout, %d requests cut", self.name, len(request_ids))
        error = RequestError.unavailable(f"{self.name} stopped (drain timeout)")
        self.worker.abort(request_ids)
        self.scheduler.send(encode(AbortRequests(request_ids)))
        for request_id in request_ids:
            self.frontend.send(encode(TextDelta.failure(request_id, error)))
        for socket in (self.frontend, self.scheduler):
            socket.close(linger=1000)  # let these last messages out

    def _guarded(self, handler: Callable[[object], None], message: object) -> None:
        # One message's failure is logged; it must never take the worker (and the server) down.
        try:
            handler(message)
        except Exception:
            logger.exception("%s failed to handle a %s", self.name, type(message).__name__)

    def _from_frontend(self, message: object) -> None:
        if isinstance(message, GenerateRequest):
            try:
                admitted = self.worker.admit(message)
            except Exception as exc:  # the client's (ParameterError, 400) or ours (500)
                if not isinstance(exc, ParameterError):
                    logger.exception("request_id=%s could not be tokenized", message.request_id)
                self.worker.abort([message.request_id])
                failure = TextDelta.failure(message.request_id, RequestError.of(exc))
                self.frontend.send(encode(failure))
                return
            self.scheduler.send(encode(admitted))
        elif isinstance(message, TokenizeRequest):
            self.frontend.send(encode(self.worker.tokenize(message)))
        elif isinstance(message, AbortRequests):
            self.worker.abort(message.request_ids)
            self.scheduler.send(encode(message))

    def _from_scheduler(self, batch: object) -> None:
        if not isinstance(batch, OutputBatch):
            return
        deltas, ended = self.worker.on_outputs(batch.outputs)
        for delta in deltas:
            self.frontend.send(encode(delta))
        if ended:  # ended here (a stop string): the scheduler stops them too
            self.scheduler.send(encode(AbortRequests(ended)))
