"""Offline data parallelism: `LLM(..., data_parallel_size=N)` runs N engines on devices of
their own and deals every batch out among them.

Replica 0 is the LLM's own engine, in the caller's process. Replicas 1..N-1 are processes of
their own (`python -m kvflow.replica`), each an `LLM` of one replica on its slice of the
GPUs (`CUDA_VISIBLE_DEVICES`, sliced as `kvflow serve` slices them). A batch is dealt out prompt
by prompt in turn, so that lengths sorted or mixed spread evenly; each replica runs its share as
one continuous batch, and the results come back in the prompts' order. Replicas share nothing,
their prefix caches included.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

from kvflow.lora_request import LoRARequest
from kvflow.outputs import GenerationResult
from kvflow.progress import Progress, ProgressSink
from services.executor.runner.devices import resolve_device
from shared.config import Config
from shared.protocol import GenerateRequest, ParameterError, SamplingParams, StatsSnapshot
from shared.replicas import replica_devices, replica_gpus

# How replica 0 runs its share: LLM.run_share (prompts, their params, adapters, progress).
RunShare = Callable[
    [list[GenerateRequest], list[SamplingParams], list[LoRARequest | None], ProgressSink],
    list[GenerationResult],
]

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5  # how often a wait looks at the replicas' processes
PROGRESS_INTERVAL_S = 0.25  # how often a replica reports its share's progress
STOP_TIMEOUT_S = 30  # how long exit waits for a replica (and its ranks) to end


class ReplicaReady(msgspec.Struct, tag=True):
    replica: int


class ReplicaJob(msgspec.Struct, tag=True):
    """A replica's share of a batch, each request with its own sampling parameters."""

    job: int  # the batch's number: every answer carries it, so a late one is told apart
    requests: list[GenerateRequest]
    loras: list[LoRARequest | None]


class ReplicaCancel(msgspec.Struct, tag=True):
    """Drop the share of batch `job`: another share failed, or the call was interrupted."""

    job: int


class ReplicaProgress(msgspec.Struct, tag=True):
    job: int
    num_tokens: int
    num_done: int


class ReplicaDone(msgspec.Struct, tag=True):
    job: int
    results: list[GenerationResult]
    stats: StatsSnapshot


class ReplicaFailed(msgspec.Struct, tag=True):
    job: int
    param: str | None  # a bad parameter's name; None: anything else, a cancel included
    message: str


FromReplica = ReplicaReady | ReplicaProgress | ReplicaDone | ReplicaFailed
FROM_PARENT = msgspec.msgpack.Decoder(ReplicaJob | ReplicaCancel)
FROM_REPLICA = msgspec.msgpack.Decoder(FromReplica)
ENCODER = msgspec.msgpack.Encoder()


class ShareFailed(Exception):
    """Another replica's share failed while replica 0 ran its own: stop it."""


# With expert parallelism across replicas, a share that fails or is cancelled stops the others'
# (their steps take rounds together: services/executor/parallel/lockstep.py).
WAVE_STOPPED = "stopped: another replica's share failed or was cancelled"


class WaveStopped(Exception):
    """A replica's share ended as another replica's failed or was cancelled."""


class OtherReplicas:
    """The LLM's hold on replicas 1..N-1. They start at once, so that they load while replica
    0 does. One that dies fails the call in hand and every later one, as a dead engine does
    when serving; so does a call interrupted twice (its replicas' state is then unknown)."""

    def __init__(self, config: Config) -> None:
        gpus = replica_gpus(config)  # too few: refused before anything starts
        self.directory = Path(tempfile.mkdtemp(prefix="kvflow-replicas-"))  # 0700
        self.sockets: list[zmq.Socket[Any]] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.poller = zmq.Poller()
        self.started = time.monotonic()  # startup_timeout counts from here
        try:
            for replica in range(1, config.data_parallel_size):
                self._start(config.replace(data_parallel_rank=replica), gpus)
        except BaseException:
            self.stop()
            raise
        self.stats: list[StatsSnapshot | None] = [None] * len(self.procs)
        self.answers: dict[int, ReplicaDone | ReplicaFailed] = {}
        self.job = 0
        self.broken: str | None = None

    def _start(self, config: Config, gpus: list[str] | None) -> None:
        """Replica `config.replica`: its config file (read once, then deleted), its socket,
        its process in a session of its own (a Ctrl-C reaches this process alone, which
        cancels the replicas' shares), on its GPUs."""
        replica = config.replica
        path = self.directory / f"config-{replica}.json"
        path.write_text(json.dumps(dataclasses.asdict(config)))
        socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PAIR)
        socket.setsockopt(zmq.LINGER, 0)
        address = f"ipc://{self.directory}/replica-{replica}"
        socket.bind(address)
        self.sockets.append(socket)
        self.poller.register(socket, zmq.POLLIN)
        argv = [sys.executable, "-m", "kvflow.replica", "--parent", str(os.getpid())]
        argv += ["--config", str(path), "--address", address]
        env = {**os.environ, **replica_devices(gpus, replica, config)}
        # The modules this process imported, wherever they came from.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.procs.append(subprocess.Popen(argv, env=env, start_new_session=True))

    def wait_ready(self, timeout: float) -> None:
        """Wait until every replica has loaded its model, at most `timeout` seconds after
        they started (while this process loaded replica 0's); the config files go then (they
        may hold the API key)."""
        waiting = set(range(len(self.procs)))
        deadline = self.started + timeout
        try:
            while waiting:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"data-parallel replicas not ready after {timeout} s")
                for index, message in self._receive(waiting):
                    if isinstance(message, ReplicaReady) and message.replica == index + 1:
                        waiting.discard(index)
        finally:
            for path in self.directory.glob("config-*.json"):
                path.unlink()

    def generate(
        self,
        run_share: RunShare,
        prompts: list[GenerateRequest],
        params: list[SamplingParams],
        loras: list[LoRARequest | None],
        progress: Progress,
    ) -> list[GenerationResult]:
        """Deal the prompts out (prompt i to replica i mod N), run replica 0's share with
        `run_share`, and return every result in the prompts' order."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        size = len(self.procs) + 1
        requests = [
            msgspec.structs.replace(prompt, sampling_params=prompt_params)
            for prompt, prompt_params in zip(prompts, params, strict=True)
        ]
        self.job += 1
        self.answers.clear()
        try:
            for index in range(len(self.procs)):
                share = slice(index + 1, None, size)
                self._send(index, ReplicaJob(self.job, requests[share], loras[share]))
            try:
                own = run_share(
                    prompts[::size], params[::size], loras[::size], _WithReplicas(progress, self)
                )
            except (ShareFailed, WaveStopped):
                own = []  # the failed share's error is raised below
            while self._pending():
                self._answer(progress)
            for index in sorted(range(len(self.procs)), key=self._stopped):
                self._results(index)  # raises a failure: one that stopped others' shares first
            results = [own, *(self._results(index) for index in range(len(self.procs)))]
        except BaseException:
            self._cancel()
            raise
        finally:
            progress.close()
            self.answers.clear()  # the replicas' results, held no longer than the call
        return [results[position % size][position // size] for position in range(len(prompts))]

    def failed_meanwhile(self, progress: Progress) -> bool:
        """Take what the replicas have sent, without waiting; whether a share failed (or a
        replica exited) while replica 0 runs its own."""
        self._answer(progress, wait=False)
        if any(isinstance(answer, ReplicaFailed) for answer in self.answers.values()):
            return True
        return any(self.procs[index].poll() is not None for index in self._pending())

    def stop(self) -> None:
        """End the replicas (each ends its own ranks first); at exit, or when the LLM closes."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
        for socket in self.sockets:
            socket.close()
        self.sockets.clear()
        shutil.rmtree(self.directory, ignore_errors=True)
        self.broken = "the LLM's data-parallel replicas were stopped"

    # ---------------------------------------------------------------- the sockets

    def _send(self, index: int, message: ReplicaJob | ReplicaCancel) -> None:
        """Send without waiting: a PAIR socket would wait forever for a replica gone."""
        self._check_alive({index})
        try:
            self.sockets[index].send(ENCODER.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            self._check_alive({index})
            raise RuntimeError(f"data-parallel replica {index + 1} takes no message") from None

    def _pending(self) -> set[int]:
        """The replicas whose share of the batch in hand has not been answered."""
        return set(range(len(self.procs))) - set(self.answers)

    def _answer(self, progress: Progress, wait: bool = True) -> None:
        for index, message in self._receive(self._pending(), wait):
            if getattr(message, "job", None) != self.job:
                continue  # a share cancelled before: its late reports and answer
            if isinstance(message, ReplicaProgress):
                progress.update(message.num_tokens, message.num_done)
            elif isinstance(message, ReplicaDone | ReplicaFailed):
                self.answers[index] = message
                if isinstance(message, ReplicaDone):
                    self.stats[index] = message.stats

    def _receive(self, indices: set[int], wait: bool = True) -> list[tuple[int, FromReplica]]:
        """The messages replicas `indices` have sent, waiting up to WATCH_INTERVAL_S for one;
        raises once one of them has exited."""
        ready = dict(self.poller.poll(int(WATCH_INTERVAL_S * 1000) if wait and indices else 0))
        messages = []
        for index in indices:
            socket = self.sockets[index]
            while socket in ready and socket.poll(0):
                messages.append((index, FROM_REPLICA.decode(socket.recv())))
        if not messages and wait:
            self._check_alive(indices)
        return messages

    def _check_alive(self, indices: set[int]) -> None:
        for index in indices:
            code = self.procs[index].poll()
            if code is not None:
                self.broken = f"data-parallel replica {index + 1} exited with code {code}"
                raise RuntimeError(self.broken)

    def _cancel(self) -> None:
        """Stop the shares still running and wait for their answers, so that the next batch
        meets idle replicas. Interrupted itself, it leaves them in an unknown state."""
        if self.broken is not None:
            return  # a replica exited: the LLM takes no more calls
        self.broken = "a data-parallel call was interrupted while cancelling its replicas"
        try:
            for index in self._pending():
                self._send(index, ReplicaCancel(self.job))
            ignored = Progress(0, enabled=False)
            while self._pending():
                self._answer(ignored)
        except RuntimeError:
            return  # a replica exited: broken, which says so
        self.broken = None

    def _stopped(self, index: int) -> bool:
        """Whether replica index + 1's share was stopped by another's failure."""
        answer = self.answers[index]
        return isinstance(answer, ReplicaFailed) and answer.message == WAVE_STOPPED

    def _results(self, index: int) -> list[GenerationResult]:
        answer = self.answers[index]
        if isinstance(answer, ReplicaDone):
            return answer.results
        if answer.param is not None:
            raise ParameterError(answer.param, answer.message)
        raise RuntimeError(f"data-parallel replica {index + 1}: {answer.message}")


class _WithReplicas:
    """Replica 0's progress: each of its reports first takes in the other replicas', and
    stops replica 0's share (ShareFailed) as soon as another share has failed."""

    def __init__(self, progress: Progress, replicas: OtherReplicas) -> None:
        self.progress, self.replicas = progress, replicas

    def update(self, num_tokens: int, num_done: int) -> None:
        if self.replicas.failed_meanwhile(self.progress):
            raise ShareFailed
        self.progress.update(num_tokens, num_done)

    def close(self) -> None:  # the whole batch's line closes once every share is in
        pass


def share_cpu_threads(device: str, replicas: int) -> None:
    """On the CPU, the replicas share the host's cores (each would take them all)."""
    if resolve_device(device).type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // replicas))
