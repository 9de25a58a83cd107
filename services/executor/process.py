"""The executor process: loads the model, reports what it loaded and what it is sized for,
then runs one forward pass per plan the scheduler sends.

A plan is prepared on the host when it arrives and launched when the scheduler says so
(LaunchStep). The executor asks for that (DeviceReady) as soon as the step in flight has
finished its forward pass, so the next one is queued while the device still computes the
last one's logits and samples: the device stays busy, and until then the scheduler can
still append requests that just arrived to the held plan (addenda). Each step is answered
as soon as its tokens are on the host.

    scheduler:  plan k+1 ─ (addenda) ─────────────── LaunchStep k+1 ──────────── plan k+2
    executor:      prepare k+1 ─ amend ─ DeviceReady ──┴ launch k+1 ─ answer k ─┘
    device:     ── step k: forward ──────────────────┴ lm_head, sample ┴ step k+1 ...

On a CPU the forward pass runs inside `launch`, so each step is answered right after it.

A plan with rows that verify drafts waits, as it is prepared, for the step in flight (the
drafts follow its tokens: runner/drafting.py); its DeviceReady goes out before that wait, so
that its LaunchStep is there when its rows are laid out.

A scheduler with no executor yet says hello (SchedulerHello, with its session); the executor
answers with ExecutorReady for that session, after dropping all it ran for another session.
So a restarted scheduler adopts the running executor, and a restarted executor, whose
unasked ExecutorReady at start tells the scheduler its old one is gone, is adopted in turn.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Any

import zmq

from services.executor.parallel.lockstep import Lockstep
from services.executor.rank_group import start_runner
from services.executor.runner.drafting import waits_for_drafts
from services.executor.runner.expert_load import ExpertLoad
from services.executor.runner.model_runner import ModelRunner
from services.executor.runner.plan_check import PlanError
from services.executor.runner.replica_rounds import idle_round
from services.executor.runner.step_watch import StepWatch
from shared.config import Config
from shared.frontend_links import HeartbeatThread
from shared.gc_heap import freeze_startup_heap
from shared.ipc import Decoder, connect_dealer, encode
from shared.protocol import (
    AddLoraAdapter,
    DeviceReady,
    LaunchStep,
    LoraAdapterAdded,
    SchedulerHello,
    SchedulerOutput,
    ToExecutor,
)
from shared.replicas import engine_component
from shared.stall_watch import StallWatch, thread_cpu_clock
from shared.wire_security import WireSecurity

logger = logging.getLogger(__name__)


def run_executor(config: Config) -> None:
    address = config.replica_address("scheduler_address")
    if address is None or config.frontend_address is None:
        raise ValueError("the executor needs --scheduler-address and --frontend-address")
    name = engine_component("executor-0", config)
    watch = StallWatch(config.engine_stall_timeout)
    security = WireSecurity.of(config)
    heartbeat = HeartbeatThread(config.frontend_address, name, stall_watch=watch, security=security)
    if config.tensor_parallel_size > 1 or config.prefill_replicas:
        # The launcher stops components with SIGTERM: rank 0 ends its group on the way out,
        # and a prefill replica's executor removes its shared KV slots (runner/kv_exports.py).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    runner = start_runner(config)
    lockstep = runner.tp.replicas.lockstep if runner.tp.replicas is not None else None
    if lockstep is not None:  # expert parallelism across replicas: take the others' rounds
        assert config.data_parallel_group is not None, "a group across replicas has its folder"
        lockstep.open_wakes(Path(config.data_parallel_group), config.startup_timeout)
    if runner.device.type == "cpu":  # a step computes in this thread: that is progress
        watch.cpu_clock = thread_cpu_clock()
    # The DEALER identity is the scheduler's name for its executor, whatever the replica.
    socket = connect_dealer(zmq.Context.instance(), address, "executor-0", security)
    model_name = config.served_model_name or runner.source.name
    if runner.lora is not None and model_name in runner.lora.modules:
        raise ValueError(f"--lora-modules: {model_name!r} is the served model's own name")
    freeze_startup_heap()  # before ready: the collection must not delay a first plan
    socket.send(encode(runner.ready_message(model_name)))
    logger.info("%s ready on %s, connected to %s", name, runner.device, address)
    try:
        steps = StepWatch(watch, config.fault_hang_step)
        load = ExpertLoad(runner.model)  # a mixture of experts' load, from the first plan on
        decoder = Decoder(ToExecutor, name)
        serve_plans(runner, socket, decoder, model_name, steps, load, lockstep)
    finally:
        heartbeat.stop()


def serve_plans(
    runner: ModelRunner,
    socket: zmq.Socket[Any],
    decoder: Decoder,
    model_name: str,
    steps: StepWatch,
    load: ExpertLoad | None = None,
    lockstep: Lockstep | None = None,
) -> None:
    """Answer finished steps, ask for the next launch, and take plans, addenda, launches,
    hellos and LoRA adapters to load (`lockstep`: expert parallelism across replicas').

    While steps are in flight it polls without blocking: their ends are seen within
    microseconds, which a blocking wait on the socket would not allow. A message it cannot
    read is dropped (the decoder logs it): were it a plan, the scheduler gives the step up
    after its stall timeout rather than wait forever."""
    asked = False  # DeviceReady sent, LaunchStep not received yet
    session: int | None = None  # the scheduler session whose plans run here

    def ask_when_due(now: bool = False) -> None:
        nonlocal asked
        if not asked and (now or runner.launch_point_passed()):
            socket.send(encode(DeviceReady()))
            asked = True

    while True:
        ask_when_due()
        while runner.oldest_finished():
            # NOTE: asked again right before each answer, as the device may have moved on
            # since the last look: the scheduler holds one plan at a time, so the plan after
            # a step must be launched before that step's answer lets it send the next one.
            ask_when_due()
            answer = runner.collect()
            if load is not None:
                answer.expert_tokens, answer.expert_ranks = load.read()
            socket.send(encode(answer))
            steps.answered(answer.step)
        if not _message_waits(socket, runner, lockstep):
            continue
        message = decoder.decode(socket.recv())
        if _rows_wait(message, runner):  # asked now, the launch is here when they are laid out
            ask_when_due(now=True)
        try:
            if _take(message, runner, socket, steps):
                asked = False
        except PlanError as exc:
            # The scheduler's view and this one have parted: start over as a new executor.
            # The unasked report makes the scheduler fail what it held and adopt this again.
            logger.error("%s; dropping every request and reporting anew", exc)
            runner.reset()
            steps.reset()
            session, asked = None, False
            socket.send(encode(runner.ready_message(model_name)))
        if isinstance(message, SchedulerHello):
            if message.session != session:  # a new scheduler: nothing from before carries on
                logger.info("adopted by scheduler session %d", message.session)
                runner.reset()
                steps.reset()
                session, asked = message.session, False
            socket.send(encode(runner.ready_message(model_name, session)))


def _message_waits(socket: zmq.Socket[Any], runner: ModelRunner, lockstep: Lockstep | None) -> bool:
    """Whether a message waits on the socket: looked at without waiting while steps are in
    flight, else waited for. With expert parallelism across replicas (`lockstep`), an executor
    with nothing to run or launch meanwhile takes the rounds of the other replicas' steps
    (services/executor/parallel/lockstep.py) while the wave goes on or a round is announced."""
    if lockstep is None or lockstep.wakes is None:
        return bool(socket.poll(0 if runner.num_in_flight else None))
    while not socket.poll(0):
        if runner.num_in_flight:
            return False
        if runner.holds_plan():  # its launch is on the way from the scheduler
            return bool(socket.poll(None))
        if lockstep.due():
            idle_round(runner)
        else:
            lockstep.wakes.wait(socket)
    return True


def _rows_wait(message: ToExecutor | None, runner: ModelRunner) -> bool:
    """Whether `message` is a plan whose rows wait for the step in flight to be laid out
    (their drafts follow its tokens: runner/drafting.py)."""
    return (
        isinstance(message, SchedulerOutput)
        and bool(message.draft_slots)
        and waits_for_drafts(message, runner.requests)
    )


def _take(
    message: ToExecutor | None, runner: ModelRunner, socket: zmq.Socket[Any], steps: StepWatch
) -> bool:
    """Act on a plan, an addendum, a launch or a LoRA adapter to load; whether it launched a
    step. Raises PlanError for a plan the runner cannot run."""
    if isinstance(message, LaunchStep):
        steps.launching(message.step)
        runner.launch(message.step)
        return True
    if isinstance(message, SchedulerOutput):
        (runner.amend if message.addendum else runner.prepare)(message)
    elif isinstance(message, AddLoraAdapter):
        error = runner.add_lora(message.lora_id, message.name, message.path)
        socket.send(encode(LoraAdapterAdded(lora_id=message.lora_id, error=error)))
    return False
