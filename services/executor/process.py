"""The executor process: loads the model, reports what it loaded and what it is sized for,
then runs one forward pass per plan the scheduler sends.

On a GPU each plan is queued on the device before the step before it is waited for and
answered, so the device runs step k+1 while the host sends step k's tokens and the scheduler
plans k+2. On a CPU `submit` computes the step itself, so step k is answered first: answered
after k+1 it would reach its requests a whole step late.
"""

from __future__ import annotations

import logging

import zmq

from services.executor.model_runner import ModelRunner
from shared.config import Config
from shared.ipc import Decoder, connect_dealer, encode, start_heartbeat
from shared.protocol import ToExecutor

logger = logging.getLogger(__name__)


def run_executor(config: Config, rank: int = 0) -> None:
    if config.scheduler_address is None or config.frontend_address is None:
        raise ValueError("the executor needs --scheduler-address and --frontend-address")
    name = f"executor-{rank}"
    heartbeat = start_heartbeat(config.frontend_address, name)
    runner = ModelRunner(config)
    socket = connect_dealer(zmq.Context.instance(), config.scheduler_address, name)
    socket.send(encode(runner.ready_message(config.served_model_name or runner.source.name)))
    logger.info("%s ready on %s, connected to %s", name, runner.device, config.scheduler_address)
    decoder = Decoder(ToExecutor, name)
    overlaps = runner.device.type == "cuda"
    has_step_in_flight = False
    try:
        while True:
            plan = decoder.decode(socket.recv())
            if plan is None:  # skipping it would leave the scheduler waiting forever
                raise RuntimeError(f"{name} received an unreadable plan")
            if has_step_in_flight and not overlaps:
                socket.send(encode(runner.collect()))
            runner.submit(plan)
            if has_step_in_flight and overlaps:
                socket.send(encode(runner.collect()))
            has_step_in_flight = True
    finally:
        heartbeat.set()
