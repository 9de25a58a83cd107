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

import atexit
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import zmq

from kvflow.lora_request import LoRARequest
from kvflow.outputs import GenerationResult
from kvflow.progress import Progress, ProgressSink
from services.executor.model_runner import resolve_device
from shared.config import Config
from shared.protocol import GenerateRequest, ParameterError, SamplingParams, StatsSnapshot
from shared.replicas import replica_devices, replica_gpus

if TYPE_CHECKING:
    from kvflow.llm import LLM

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5  # how often a wait looks at the replicas' processes
PROGRESS_INTERVAL_S = 0.25  # how often a replica reports its share's progress
STOP_TIMEOUT_S = 10  # how long exit waits for a replica to end before killing it


class ReplicaReady(msgspec.Struct, tag=True):
    replica: int


class ReplicaJob(msgspec.Struct, tag=True):
    """A replica's share of a batch, each request with its own sampling parameters."""

    requests: list[GenerateRequest]
    loras: list[LoRARequest | None]


class ReplicaCancel(msgspec.Struct, tag=True):
    """Drop the share in hand: another replica's share failed."""


class ReplicaProgress(msgspec.Struct, tag=True):
    num_tokens: int
    num_done: int


class ReplicaDone(msgspec.Struct, tag=True):
    results: list[GenerationResult]
    stats: StatsSnapshot


class ReplicaFailed(msgspec.Struct, tag=True):
    param: str | None  # a bad parameter's name; None: anything else, a cancel included
    message: str


FROM_PARENT = msgspec.msgpack.Decoder(ReplicaJob | ReplicaCancel)
FROM_REPLICA = msgspec.msgpack.Decoder(ReplicaReady | ReplicaProgress | ReplicaDone | ReplicaFailed)
ENCODER = msgspec.msgpack.Encoder()


class OtherReplicas:
    """The LLM's hold on replicas 1..N-1. They start at once, so that they load while replica
    0 does, and stop when this process exits. One that dies fails the call in hand and every
    later one, as a dead engine does when serving."""

    def __init__(self, config: Config) -> None:
        gpus = replica_gpus(config)  # too few: refused before anything starts
        self.directory = Path(tempfile.mkdtemp(prefix="kvflow-replicas-"))  # 0700
        self.config_path = self.directory / "config.json"
        one = config.replace(data_parallel_size=1)
        self.config_path.write_text(json.dumps(dataclasses.asdict(one)))
        context: zmq.Context[Any] = zmq.Context.instance()
        self.sockets: list[zmq.Socket[Any]] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        for replica in range(1, config.data_parallel_size):
            socket = context.socket(zmq.PAIR)
            socket.setsockopt(zmq.LINGER, 0)
            address = f"ipc://{self.directory}/replica-{replica}"
            socket.bind(address)
            argv = [sys.executable, "-m", "kvflow.replica", "--parent", str(os.getpid())]
            argv += ["--config", str(self.config_path), "--replica", str(replica)]
            argv += ["--replicas", str(config.data_parallel_size)]
            env = {**os.environ, **replica_devices(gpus, replica, config)}
            self.procs.append(subprocess.Popen([*argv, "--address", address], env=env))
            self.sockets.append(socket)
        self.stats: list[StatsSnapshot | None] = [None] * len(self.procs)
        self.answers: dict[int, ReplicaDone | ReplicaFailed] = {}
        self.broken: str | None = None
        atexit.register(self.stop)

    def wait_ready(self, timeout: float) -> None:
        """Wait until every replica has loaded its model; the config file goes then."""
        waiting = set(range(len(self.procs)))
        deadline = time.monotonic() + timeout
        while waiting:
            if time.monotonic() > deadline:
                raise RuntimeError(f"data-parallel replicas not ready after {timeout} s")
            for index, message in self._receive(waiting):
                if isinstance(message, ReplicaReady):
                    waiting.discard(index)
        self.config_path.unlink()  # it may hold the API key

    def generate(
        self,
        llm: LLM,
        prompts: list[GenerateRequest],
        params: list[SamplingParams],
        loras: list[LoRARequest | None],
        progress: Progress,
    ) -> list[GenerationResult]:
        """Deal the prompts out (prompt i to replica i mod N), run replica 0's share in
        `llm`, and return every result in the prompts' order."""
        size = len(self.procs) + 1
        if self.broken is not None:
            raise RuntimeError(self.broken)
        requests = [
            msgspec.structs.replace(prompt, sampling_params=prompt_params)
            for prompt, prompt_params in zip(prompts, params, strict=True)
        ]
        for index in range(len(self.procs)):
            share = slice(index + 1, None, size)
            self._send(index, ReplicaJob(requests[share], loras[share]))
        self.answers.clear()
        try:
            own = llm.run_share(prompts[::size], params[::size], loras[::size], self.hook(progress))
        except BaseException:
            self._cancel()
            raise
        while self._pending():
            self._answer(progress)
        progress.close()
        results = [own, *(self._results(index) for index in range(len(self.procs)))]
        ordered: list[GenerationResult] = []
        for position in range(len(prompts)):
            ordered.append(results[position % size][position // size])
        return ordered

    def hook(self, progress: Progress) -> ProgressSink:
        """`progress`, also taking the other replicas' reports each time replica 0 reports."""
        return _WithReplicas(progress, self)

    def drain(self, progress: Progress) -> None:
        """Take the reports and answers the replicas have sent, without waiting."""
        self._answer(progress, wait=False)

    def stop(self) -> None:
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
            if isinstance(message, ReplicaProgress):
                progress.update(message.num_tokens, message.num_done)
            elif isinstance(message, ReplicaDone | ReplicaFailed):
                self.answers[index] = message
                if isinstance(message, ReplicaDone):
                    self.stats[index] = message.stats

    def _receive(self, indices: set[int], wait: bool = True) -> list[tuple[int, Any]]:
        """The messages replicas `indices` have sent, waiting up to WATCH_INTERVAL_S for one;
        raises once one of them has exited."""
        poller = zmq.Poller()
        for index in indices:
            poller.register(self.sockets[index], zmq.POLLIN)
        ready = dict(poller.poll(int(WATCH_INTERVAL_S * 1000) if wait else 0))
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
        meets idle replicas."""
        for index in self._pending():
            self._send(index, ReplicaCancel())
        ignored = Progress(0, enabled=False)
        while self._pending():
            self._answer(ignored)

    def _results(self, index: int) -> list[GenerationResult]:
        answer = self.answers[index]
        if isinstance(answer, ReplicaDone):
            return answer.results
        if answer.param is not None:
            raise ParameterError(answer.param, answer.message)
        raise RuntimeError(f"data-parallel replica {index + 1}: {answer.message}")


class _WithReplicas:
    """Replica 0's progress: each of its reports first takes in the other replicas'."""

    def __init__(self, progress: Progress, replicas: OtherReplicas) -> None:
        self.progress, self.replicas = progress, replicas

    def update(self, num_tokens: int, num_done: int) -> None:
        self.replicas.drain(self.progress)
        self.progress.update(num_tokens, num_done)

    def close(self) -> None:  # the whole batch's line closes once every share is in
        pass


def share_cpu_threads(device: str, replicas: int) -> None:
    """On the CPU, the replicas share the host's cores (each would take them all)."""
    if resolve_device(device).type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // replicas))
