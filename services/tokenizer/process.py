"""A tokenizer worker process: one DEALER to the frontend, one to the scheduler."""

from __future__ import annotations

import logging

import zmq

from services.tokenizer.hf_tokenizer import load_tokenizer
from services.tokenizer.worker import TokenizerWorker
from shared.config import Config
from shared.ipc import Decoder, connect_dealer, encode, start_heartbeat
from shared.model_config import derive_max_model_len, load_model_config, resolve_model_source
from shared.protocol import (
    AbortRequests,
    EngineRequest,
    GenerateRequest,
    OutputBatch,
    TokenizeRequest,
)

logger = logging.getLogger(__name__)
FromFrontend = GenerateRequest | TokenizeRequest | AbortRequests


def run_tokenizer(config: Config) -> None:
    if config.scheduler_address is None or config.frontend_address is None:
        raise ValueError("a tokenizer worker needs --scheduler-address and --frontend-address")
    name = f"tokenizer-{config.worker_index}"
    source = resolve_model_source(config.model)
    tokenizer = load_tokenizer(source, config.tokenizer)
    if tokenizer is None:
        raise ValueError(f"{source.name} ships no tokenizer; pass --tokenizer")
    max_model_len = derive_max_model_len(config.max_model_len, load_model_config(source))
    worker = TokenizerWorker(tokenizer, max_model_len)
    context = zmq.Context.instance()
    frontend = connect_dealer(context, config.frontend_address, name)
    scheduler = connect_dealer(context, config.scheduler_address, name)
    heartbeat = start_heartbeat(config.frontend_address, name)
    logger.info("%s ready", name)
    try:
        _serve(worker, frontend, scheduler, name)
    finally:
        heartbeat.set()


def _serve(worker: TokenizerWorker, frontend: zmq.Socket, scheduler: zmq.Socket, name: str) -> None:
    from_frontend = Decoder(FromFrontend, f"{name} (frontend)")
    from_scheduler = Decoder(OutputBatch, f"{name} (scheduler)")
    poller = zmq.Poller()
    poller.register(frontend, zmq.POLLIN)
    poller.register(scheduler, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if frontend in ready:
            _guarded(
                name,
                _from_frontend,
                worker,
                frontend,
                scheduler,
                from_frontend.decode(frontend.recv()),
            )
        if scheduler in ready:
            _guarded(
                name,
                _from_scheduler,
                worker,
                frontend,
                scheduler,
                from_scheduler.decode(scheduler.recv()),
            )


def _guarded(name: str, handler, *args: object) -> None:
    # One message's failure is logged; it must never take the worker (and the server) down.
    try:
        handler(*args)
    except Exception:
        logger.exception("%s failed to handle a message", name)


def _from_frontend(
    worker: TokenizerWorker, frontend: zmq.Socket, scheduler: zmq.Socket, message: object
) -> None:
    if isinstance(message, GenerateRequest):
        admitted = worker.admit(message)  # a request, or an error delta
        target = scheduler if isinstance(admitted, EngineRequest) else frontend
        target.send(encode(admitted))
    elif isinstance(message, TokenizeRequest):
        frontend.send(encode(worker.tokenize(message)))
    elif isinstance(message, AbortRequests):
        worker.abort(message.request_ids)
        scheduler.send(encode(message))


def _from_scheduler(
    worker: TokenizerWorker, frontend: zmq.Socket, scheduler: zmq.Socket, batch: object
) -> None:
    if not isinstance(batch, OutputBatch):
        return
    deltas, stopped = worker.on_outputs(batch.outputs)
    for delta in deltas:
        frontend.send(encode(delta))
    if stopped:  # a stop string ended these: the scheduler stops them too
        scheduler.send(encode(AbortRequests(stopped)))
