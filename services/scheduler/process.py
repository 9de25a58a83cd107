"""The scheduler process: sockets and the step loop around the pure `Scheduler` core.

It binds one ROUTER. Tokenizer workers send requests and aborts through it and get their
requests' outputs back; the executor connects to it, announces itself with ExecutorReady,
then receives one plan per step and answers each with the sampled tokens.

The loop is pipelined like the offline engine: plan k+1 is sent before the scheduler waits for
step k's tokens, and the executor answers step k once plan k+1 is queued on its device. So
every plan but the first is answered one plan late; an empty plan flushes the last step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict

import zmq

from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.config import Config
from shared.ipc import Decoder, bind_router, connect_dealer, encode, start_heartbeat
from shared.model_config import load_model_config, resolve_model_source
from shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequests,
    EngineRequest,
    ExecutorReady,
    FinishReason,
    ModelRunnerOutput,
    OutputBatch,
    ParameterError,
    QueueFullError,
    RequestOutput,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)
Inbound = EngineRequest | AbortRequests | ExecutorReady | ModelRunnerOutput
STATS_INTERVAL_S = 0.1


class SchedulerProcess:
    def __init__(self, config: Config) -> None:
        if config.scheduler_address is None or config.frontend_address is None:
            raise ValueError("the scheduler needs --scheduler-address and --frontend-address")
        self.config = config
        context = zmq.Context.instance()
        self.router = bind_router(context, config.scheduler_address)
        self.frontend = connect_dealer(context, config.frontend_address, "scheduler")
        self.decoder = Decoder(Inbound, "scheduler")
        self.owners: dict[str, bytes] = {}  # request_id -> identity of its tokenizer worker
        self.executor: bytes | None = None
        self.scheduler: Scheduler | None = None
        self._in_flight: SchedulerOutput | None = None  # sent, not yet answered
        self._last_stats = 0.0
        self._heartbeat = start_heartbeat(config.frontend_address, "scheduler")

    def run(self) -> None:
        ready = self._wait_for_executor()
        self.scheduler = self._build_core(ready)
        logger.info(
            "scheduler ready: %d KV blocks of %d tokens, max_model_len=%d, bound at %s",
            ready.num_blocks,
            self.config.block_size,
            ready.max_model_len,
            self.config.scheduler_address,
        )
        while True:
            idle = not self.scheduler.has_unfinished()
            self._drain_inbox(timeout_ms=50 if idle else 0)
            if self.scheduler.has_unfinished():
                self._step()
            self._maybe_send_stats()

    def _wait_for_executor(self) -> ExecutorReady:
        while True:
            identity, message = self._recv()
            if isinstance(message, ExecutorReady):
                if message.protocol_version != PROTOCOL_VERSION:
                    raise RuntimeError(
                        f"executor speaks protocol {message.protocol_version}, "
                        f"scheduler {PROTOCOL_VERSION}"
                    )
                self.executor = identity
                return message
            if message is not None:  # requests before the engine is up: refuse them
                self._handle(identity, message)

    def _build_core(self, ready: ExecutorReady) -> Scheduler:
        model_config = load_model_config(resolve_model_source(self.config.model))
        return Scheduler(
            SchedulerConfig(
                num_blocks=ready.num_blocks,
                block_size=self.config.block_size,
                max_model_len=ready.max_model_len,
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                enable_prefix_caching=self.config.enable_prefix_caching,
                enable_chunked_prefill=self.config.enable_chunked_prefill,
                eos_token_ids=model_config.eos_token_ids,
                vocab_size=model_config.vocab_size,
                max_queued_requests=self.config.max_queued_requests,
            )
        )

    # ---------------------------------------------------------------- inbox

    def _recv(self) -> tuple[bytes, object | None]:
        identity, data = self.router.recv_multipart()
        return identity, self.decoder.decode(data)

    def _drain_inbox(self, timeout_ms: int) -> None:
        if not self.router.poll(timeout_ms):
            return
        while self.router.poll(0):
            identity, message = self._recv()
            if message is not None:
                self._handle(identity, message)

    def _handle(self, identity: bytes, message: object) -> None:
        if isinstance(message, EngineRequest):
            self._add(identity, message)
        elif isinstance(message, AbortRequests):
            self._publish(self.scheduler.abort(message.request_ids) if self.scheduler else [])
        else:
            logger.warning("unexpected %s from %r", type(message).__name__, identity)

    def _add(self, identity: bytes, request: EngineRequest) -> None:
        try:
            if self.scheduler is None:
                raise RuntimeError("the engine is still starting")
            self.scheduler.add_request(request)
        except Exception as exc:
            param = exc.param if isinstance(exc, ParameterError) else None
            code = exc.code if isinstance(exc, QueueFullError) else None
            if param is None and code is None:
                logger.exception("request_id=%s could not be added", request.request_id)
            error = RequestOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                error=str(exc),
                error_param=param,
                error_code=code,
                num_prompt_tokens=len(request.prompt_token_ids),
            )
            self._send_outputs(identity, [error])
            return
        # Only now: a refused duplicate id must not take over the original's owner.
        self.owners[request.request_id] = identity

    # ---------------------------------------------------------------- stepping

    def _step(self) -> None:
        plan = self.scheduler.schedule()
        in_flight = self._in_flight
        if in_flight is None and not plan.num_scheduled_tokens and not plan.finished_request_ids:
            return  # nothing to run, to flush, or for the executor to forget
        self.router.send_multipart([self.executor, encode(plan)])
        self._in_flight = plan
        if in_flight is not None:
            result = self._wait_for_result(in_flight)
            self._publish(self.scheduler.update(in_flight, result))

    def _wait_for_result(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        # Requests and aborts that arrive meanwhile are handled now: an abort frees blocks
        # that steps in flight may still write, which is safe because any later step that
        # reuses them runs after those on the executor's device queue.
        deadline = time.monotonic() + self.config.step_timeout
        while time.monotonic() < deadline:
            self._maybe_send_stats()  # a long step is not a dead scheduler
            if not self.router.poll(500):
                continue
            identity, message = self._recv()
            if isinstance(message, ModelRunnerOutput) and message.step == plan.step:
                return message
            if message is not None:
                self._handle(identity, message)
        raise RuntimeError(
            f"the executor did not answer step {plan.step} within {self.config.step_timeout} s"
        )

    def _publish(self, outputs: list[RequestOutput]) -> None:
        by_owner: dict[bytes, list[RequestOutput]] = defaultdict(list)
        for output in outputs:
            owner = self.owners.get(output.request_id)
            if owner is None:
                continue
            by_owner[owner].append(output)
            if output.finished:
                del self.owners[output.request_id]
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
            if self.scheduler is not None:
                self.scheduler.abort(lost)
            for request_id in lost:
                self.owners.pop(request_id, None)

    def _maybe_send_stats(self) -> None:
        if self.scheduler is None:
            return
        now = time.monotonic()
        if now - self._last_stats < STATS_INTERVAL_S:
            return
        self._last_stats = now
        snapshot = self.scheduler.stats()
        # If the frontend is not reading, drop it: a later snapshot replaces this one.
        with contextlib.suppress(zmq.Again):
            self.frontend.send(encode(snapshot), flags=zmq.DONTWAIT)
