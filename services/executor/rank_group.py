"""The ranks of a tensor-parallel executor (`--tensor-parallel-size N`).

Rank 0 is the executor the scheduler (or `kvflow.LLM`) talks to. It starts ranks 1..N-1 as
processes of its own, and relays to them each plan, addendum, launch and reset as it takes it
(one ZeroMQ publish to all of them: `PlanRelay`), so every rank runs the same steps in the
same order; each LoRA adapter rank 0 takes is relayed too, and every rank reads its own part
of it. Only rank 0 answers. Every rank samples the same tokens from the same gathered logits
with the same seeds, so nothing sampled needs to travel back.

    scheduler ── plans, launches ──> rank 0 ── the same, relayed ──> ranks 1..N-1
    scheduler <── sampled tokens ─── rank 0        (torch.distributed between all ranks)

The group lives and dies together: rank 0 exits (code 1) as soon as another rank exits, and
the others exit when rank 0 is gone, so a dead rank takes the engine down as a dead executor
does. Each rank beats to the frontends as executor-<rank>, so a stuck rank shows in /health.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zmq

from services.executor.parallel.layout import ShardLayout
from services.executor.parallel.tensor_parallel import TensorParallel
from services.executor.parallel.world import join_world, leave_world
from services.executor.runner.devices import resolve_device
from services.executor.runner.model_runner import ModelRunner
from services.executor.runner.plan_check import PlanError
from services.executor.runner.plan_relay import WATCH_INTERVAL_S, PlanRelay
from services.executor.runner.replica_rounds import run_padding
from services.executor.runner.step_watch import StepWatch
from shared.config import Config, config_from_file
from shared.frontend_links import HeartbeatThread
from shared.gc_heap import freeze_startup_heap
from shared.ipc import Decoder
from shared.model_config import load_model_config, resolve_model_source
from shared.protocol import (
    AddLoraAdapter,
    LaunchStep,
    PaddingStep,
    ResetRanks,
    SchedulerOutput,
    ToRanks,
)
from shared.replicas import engine_component, experts_across_replicas
from shared.stall_watch import StallWatch
from shared.wire_security import WireSecurity

logger = logging.getLogger(__name__)
TEARDOWN_S = 10  # how long rank 0 waits at exit for the other ranks and the group to end
# Rank 0's runners that have other ranks, each with its way out of their group: run at exit,
# or earlier by `end_group`.
_group_exits: weakref.WeakKeyDictionary[ModelRunner, Callable[[], None]] = (
    weakref.WeakKeyDictionary()
)


def start_runner(config: Config) -> ModelRunner:
    """Rank 0's model runner; with --tensor-parallel-size N > 1, the other N-1 ranks are
    started first, and the runner relays its plans to them."""
    size = config.tensor_parallel_size
    if size == 1 and experts_across_replicas(config):  # a group of replicas' single ranks
        runner = ModelRunner(config, join_world(config, 0, None, resolve_device(config.device)))
        atexit.register(_leave_world)
        return runner
    if size == 1:  # expert parallelism over one rank: every expert whole, as without it
        return ModelRunner(config, TensorParallel(expert_parallel=config.enable_expert_parallel))
    check_group(config)
    directory = Path(tempfile.mkdtemp(prefix="kvflow-ranks-"))  # 0700: this user's alone
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    config_path = directory / "config.json"
    config_path.write_text(json.dumps(dataclasses.asdict(config)))
    relay = PlanRelay(f"ipc://{directory}/plans")
    ranks = OtherRanks([_spawn_rank(config_path, rank, directory) for rank in range(1, size)])
    atexit.register(ranks.stop)
    try:
        relay.wait_for(size - 1, config.startup_timeout)
        config_path.unlink()  # every rank read it before subscribing; it may hold the API key
        logger.info("started executor ranks 1..%d; joining the tensor-parallel group", size - 1)
        runner = ModelRunner(
            config, join_world(config, 0, directory, resolve_device(config.device)), relay
        )
    except BaseException:  # the ranks and the group end with the start (another may follow)
        ranks.stop()
        leave_world()
        raise
    held = weakref.ref(runner)
    atexit.register(_leave_group, held, ranks, _leave_world)  # runs before ranks.stop
    _group_exits[runner] = functools.partial(_leave_group, held, ranks)
    return runner


def end_group(runner: ModelRunner, at_exit: bool = False) -> None:
    """End rank 0's other ranks, then its own part of their group, before exit would (an
    `LLM` closed: another may then start a group of its own in this process), or `at_exit`
    (an `LLM` closing there: a teardown that hangs then exits the process). Nothing to do for
    a runner without other ranks, or once done."""
    leave = _group_exits.pop(runner, None)
    if leave is not None:
        atexit.unregister(_leave_group)  # registered once a process: one group at a time
        leave(_leave_world if at_exit else _leave_world_now)


def check_group(config: Config) -> None:
    """Refuse a group that cannot run, before any rank starts: heads that do not split, or
    fewer GPUs than ranks."""
    size = config.tensor_parallel_size
    tp = TensorParallel(0, size, expert_parallel=config.enable_expert_parallel)
    ShardLayout.of(load_model_config(resolve_model_source(config.model)), tp)
    if resolve_device(config.device).type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"--tensor-parallel-size {size} needs {size} GPUs; "
            f"{torch.cuda.device_count()} are visible"
        )


def _spawn_rank(config_path: Path, rank: int, directory: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "services.executor.rank_group", "--parent", str(os.getpid())]
    argv += ["--config", str(config_path), "--rank", str(rank), "--group", str(directory)]
    return subprocess.Popen(argv)


class OtherRanks:
    """Rank 0's hold on ranks 1..N-1: it exits as soon as one of them does (its collectives
    would wait forever), unless it is stopping them itself."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.stopping = threading.Event()
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self.stopping.is_set():
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self.stopping.is_set():
                    logger.error("executor rank %d exited with code %d; exiting", rank, code)
                    logging.shutdown()
                    os._exit(1)
            time.sleep(WATCH_INTERVAL_S)

    def stop(self) -> None:
        self.stopping.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=TEARDOWN_S)
            except subprocess.TimeoutExpired:
                proc.kill()


def _leave_group(
    runner: weakref.ref[ModelRunner], ranks: OtherRanks, leave: Callable[[], None]
) -> None:
    """Rank 0 at exit or at `end_group`: end the other ranks, then its own part of the group
    (`leave`), before Python's teardown would (in no set order, and NCCL's can hang once CUDA
    graphs hold collectives: pytorch#115388)."""
    started = time.monotonic()
    ranks.stop()
    held = runner()
    if held is not None:
        held.graphs = None  # the captured collectives go before their communicator
    del held
    gc.collect()
    leave()
    logger.debug("left the tensor-parallel group in %.1f s", time.monotonic() - started)


def _leave_world() -> None:
    """End this process's part of the group at exit; if that hangs, exit without it (a thread
    left inside NCCL would hang the interpreter's own teardown)."""
    if not leave_world():  # it logged why
        logging.shutdown()
        os._exit(1)


def _leave_world_now() -> None:
    """End this process's part of the group before exit (`end_group`); if that hangs, say so
    to the caller, whose process goes on (the group's teardown is left behind)."""
    if not leave_world():
        atexit.register(_leave_world)  # its teardown left behind: exit must not wait for it
        raise RuntimeError(f"the tensor-parallel group did not end in {TEARDOWN_S} s")


def watch_parent(parent: int) -> None:
    """Start a thread that exits this process as soon as process `parent` (by the pid it
    passed, not a getppid() read later: it may be gone already) is gone: a rank other than
    0, or a data-parallel replica (kvflow/replica.py)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_INTERVAL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def follow(runner: ModelRunner, socket: zmq.Socket[Any], steps: StepWatch) -> None:
    """A rank other than 0: run what rank 0 relays, in its order, and drop the answers.

    A plan it cannot run fails on rank 0 too (the same check of the same state), which then
    resets every rank: the next message is that reset. Anything else next, or a relayed
    message it cannot read, means the ranks have parted (rank 0 ran what this rank could not,
    and its collectives would wait for this rank forever): it exits, and so takes the group
    down.
    """
    decoder = Decoder(ToRanks, f"executor-{runner.tp.rank}")
    failed: PlanError | None = None  # the plan error not yet followed by rank 0's reset
    while True:
        while runner.oldest_finished():
            steps.answered(runner.collect().step)
        if not socket.poll(0 if runner.num_in_flight else None):
            continue
        message = decoder.decode(socket.recv())
        if message is None:
            raise RuntimeError("a relayed message that cannot be read: the ranks have parted")
        if failed is not None and not isinstance(message, ResetRanks):
            raise RuntimeError(f"rank 0 went on past a plan this rank could not run ({failed})")
        failed = None
        try:
            if isinstance(message, LaunchStep):
                # Rank 0 launches once its own oldest step has ended; this rank's may still
                # be sampling (an empty step ties no collective between them): wait for it.
                while runner.num_in_flight > 1:
                    steps.answered(runner.collect().step)
                steps.launching(message.step)
                runner.launch(message.step, message.replica_rows, message.mixed)
            elif isinstance(message, PaddingStep):
                run_padding(runner, message.replica_rows, message.mixed)
            elif isinstance(message, SchedulerOutput):
                (runner.amend if message.addendum else runner.prepare)(message)
            elif isinstance(message, AddLoraAdapter):
                error = runner.add_lora(message.lora_id, message.name, message.path)
                if error is not None:  # rank 0 took it: the ranks' adapters would part
                    raise RuntimeError(f"rank 0 took a LoRA adapter this rank cannot: {error}")
            else:
                runner.reset()
                steps.reset()
        except PlanError as exc:
            logger.warning("%s; rank 0 resets the group", exc)
            failed = exc


def main() -> None:
    """A rank other than 0, started by rank 0 (`start_runner`)."""
    parser = argparse.ArgumentParser(prog="kvflow executor rank")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--group", type=Path, required=True)
    parser.add_argument("--parent", type=int, required=True)  # rank 0's pid
    args = parser.parse_args()
    config = config_from_file(args.config)
    name = engine_component(f"executor-{args.rank}", config)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
    )
    logging.getLogger().setLevel(config.log_level.upper())
    watch_parent(args.parent)
    context: zmq.Context[Any] = zmq.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(f"ipc://{args.group}/plans")
    watch = StallWatch(config.engine_stall_timeout)
    if config.frontend_address is not None:
        HeartbeatThread(
            config.frontend_address, name, stall_watch=watch, security=WireSecurity.of(config)
        )
    runner = ModelRunner(
        config, join_world(config, args.rank, args.group, resolve_device(config.device, args.rank))
    )
    freeze_startup_heap()
    logger.info("%s ready on %s", name, runner.device)
    follow(runner, socket, StepWatch(watch))


if __name__ == "__main__":
    main()
