"""A replica of an `LLM(..., data_parallel_size=N)` other than replica 0: a process that
`OtherReplicas` (kvflow/data_parallel.py) starts on its slice of the GPUs. It loads an `LLM` of
one replica, then runs each share of a batch the parent sends, and reports as it goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvflow.data_parallel import (
    ENCODER,
    FROM_PARENT,
    PROGRESS_INTERVAL_S,
    WAVE_STOPPED,
    ReplicaDone,
    ReplicaFailed,
    ReplicaJob,
    ReplicaProgress,
    ReplicaReady,
    WaveStopped,
    share_cpu_threads,
)
from kvflow.llm import LLM
from services.executor.rank_group import watch_parent
from shared.config import config_from_file
from shared.protocol import ParameterError

logger = logging.getLogger(__name__)


class ReplicaCancelled(Exception):
    """The parent cancelled the share this replica is running."""


class _ToParent:
    """A replica's progress, sent to the parent at most every PROGRESS_INTERVAL_S. Each report
    also reads what the parent sent: a cancel of this share raises ReplicaCancelled here,
    inside the replica's step loop; anything else waits in `later` for the replica's loop."""

    def __init__(self, socket: zmq.Socket[Any], job: int, later: list[ReplicaJob]) -> None:
        self.socket, self.job, self.later = socket, job, later
        self.tokens = self.done = 0
        self.last = time.monotonic()

    def update(self, num_tokens: int, num_done: int) -> None:
        self.tokens += num_tokens
        self.done += num_done
        while self.socket.poll(0):
            message = FROM_PARENT.decode(self.socket.recv())
            if isinstance(message, ReplicaJob):
                self.later.append(message)
            elif message.job == self.job:
                raise ReplicaCancelled
        if time.monotonic() - self.last > PROGRESS_INTERVAL_S:
            self.close()

    def close(self) -> None:
        self.socket.send(ENCODER.encode(ReplicaProgress(self.job, self.tokens, self.done)))
        self.tokens = self.done = 0
        self.last = time.monotonic()


def serve_parent(llm: LLM, socket: zmq.Socket[Any]) -> None:
    """A replica's loop: run each share the parent sends, answer with its results or why it
    failed. A cancel that comes while idle is late (the share had ended): it is dropped."""
    later: list[ReplicaJob] = []
    while True:
        job = later.pop(0) if later else FROM_PARENT.decode(socket.recv())
        if isinstance(job, ReplicaJob):
            socket.send(ENCODER.encode(_run(llm, job, _ToParent(socket, job.job, later))))


def _run(llm: LLM, job: ReplicaJob, progress: _ToParent) -> ReplicaDone | ReplicaFailed:
    params = [request.sampling_params for request in job.requests]
    try:
        results = llm.run_share(job.requests, params, job.loras, progress)
    except ParameterError as exc:
        return ReplicaFailed(job.job, exc.param, exc.message)
    except ReplicaCancelled:
        return ReplicaFailed(job.job, None, "cancelled")
    except WaveStopped:
        return ReplicaFailed(job.job, None, WAVE_STOPPED)
    except Exception as exc:  # the parent raises it; this replica takes the next share
        logger.exception("the share of batch %d failed", job.job)
        return ReplicaFailed(job.job, None, f"{type(exc).__name__}: {exc}")
    stats = msgspec.structs.replace(llm.stats(), replica=llm.config.replica)
    return ReplicaDone(job.job, results, stats)


def main() -> None:
    """A replica of an `LLM(..., data_parallel_size=N)` (its config's data_parallel_rank),
    started by it (`OtherReplicas`)."""
    parser = argparse.ArgumentParser(prog="kvflow data-parallel replica")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args()
    config = config_from_file(args.config)
    logging.basicConfig(
        level=config.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [replica {config.replica}] %(name)s: %(message)s",
    )
    watch_parent(args.parent)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # exit through atexit's teardown
    share_cpu_threads(config.device, config.data_parallel_size)
    llm = LLM(**dataclasses.asdict(config))
    context: zmq.Context[Any] = zmq.Context.instance()
    socket = context.socket(zmq.PAIR)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(args.address)
    socket.send(ENCODER.encode(ReplicaReady(config.replica)))
    serve_parent(llm, socket)


if __name__ == "__main__":
    main()
