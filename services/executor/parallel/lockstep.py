"""Data-parallel replicas that exchange tokens in their mixture-of-experts layers
(services/executor/parallel/replica_experts.py) run their steps together: step k of one replica
meets step k of every other in each such layer's collectives. So every launch is a *round*:
each replica's first rank says how many rows its step has, and all learn every replica's (the
most is how many rows each sends in the step's exchanges) and whether any still has work.

A replica with nothing to launch while others have work takes part anyway: it runs a step of
padding rows (services/executor/runner/replica_rounds.py), which computes nothing of its own
and only serves its experts. A round in which no replica has work ends a *wave*: the replicas
stop taking rounds until one of them launches again.

The rounds are an all-gather over a gloo group of the replicas' first ranks, on the host, before
each step is queued on the device; the step's own collectives then run on the device (NCCL).

Serving, an executor with nothing to run waits for its scheduler's messages, and would miss
the rounds another replica starts: each replica's first rank announces every round it takes
to the others' (`Wakes`), and one whose wave has ended takes a round when told of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import zmq


@dataclass(frozen=True)
class Round:
    rows: tuple[int, ...]  # each replica's rows in this round's step (0: none, or padding)
    busy: bool  # whether any replica has work still (else the wave ends here)
    stop: bool = False  # whether a replica's work failed or was cancelled: all stop theirs
    # Whether a replica's step is mixed (a request of more than one token): the round's rows
    # are then a mixed step's graph's (services/executor/runner/cuda_graphs.py `rows_for`).
    mixed: bool = False

    @property
    def padded(self) -> int:
        """The rows each replica sends in the step's exchanges: the most any has (0: none
        runs a step)."""
        return max(self.rows)


class Lockstep:
    """A replica's first rank's part in the rounds."""

    def __init__(self, replica: int, replicas: int, group: Any) -> None:
        """`group`: a gloo group of every replica's first rank."""
        self.replica = replica
        self.replicas = replicas
        self.group = group
        self.rounds = 0  # taken so far: the same count on every replica
        self.busy = False  # whether the last round had work (the wave goes on)
        self.stop_asked = False  # whether a round of this wave asked every replica to stop
        self.wakes: Wakes | None = None  # serving: `open_wakes`

    def open_wakes(self, directory: Path, timeout_s: float) -> None:
        """Serving: announce each round to the other replicas, and hear theirs."""
        self.wakes = Wakes(directory, self.replica, self.replicas, timeout_s)

    def join(self, rows: int, busy: bool, stop: bool = False, mixed: bool = False) -> Round:
        """Take the next round with a step of `rows` rows (0: none, or padding only); `busy`:
        whether this replica has work still; `stop`: whether its work failed or was cancelled
        (offline, every replica's share then ends: kvflow/llm.py); `mixed`: whether its step
        is mixed. Waits for every replica."""
        if self.wakes is not None:
            self.wakes.announce(self.rounds)
        mine = torch.tensor([rows, int(busy), int(stop), int(mixed)], dtype=torch.int64)
        values = [torch.empty_like(mine) for _ in range(self.replicas)]
        dist.all_gather(values, mine, group=self.group)
        self.rounds += 1
        if self.wakes is not None:
            self.wakes.hear()
        each_rows, each_busy, each_stop, each_mixed = torch.stack(values).T.tolist()
        taken = Round(tuple(each_rows), any(each_busy), any(each_stop), any(each_mixed))
        self.busy = taken.busy
        self.stop_asked = (self.stop_asked or taken.stop) and taken.busy  # until the wave ends
        return taken

    def due(self) -> bool:
        """Whether this replica should take the next round with nothing of its own: the wave
        goes on, or another replica has announced the round."""
        return self.busy or (self.wakes is not None and self.wakes.announced(self.rounds))


class Wakes:
    """A replica's first rank's announcements of the rounds it takes (an XPUB socket in the
    replicas' group folder), and its subscription to the other replicas'."""

    def __init__(self, directory: Path, replica: int, replicas: int, timeout_s: float) -> None:
        """Returns once every other replica has subscribed, so that no announcement is lost
        (a subscriber that joins late misses what was sent before)."""
        context = zmq.Context.instance()
        self.pub = context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # each subscriber's subscription, not one
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"ipc://{directory}/wakes-{replica}")
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        for other in range(replicas):
            if other != replica:
                self.sub.connect(f"ipc://{directory}/wakes-{other}")
        self.heard = -1  # the last round announced by another replica
        subscribed, deadline = 0, time.monotonic() + timeout_s
        while subscribed < replicas - 1:
            if not self.pub.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                raise RuntimeError(f"replicas' executors not all there after {timeout_s} s")
            subscribed += self.pub.recv()[:1] == b"\x01"

    def announce(self, round_number: int) -> None:
        self.pub.send(round_number.to_bytes(8, "little"))

    def hear(self) -> None:
        """Take the announcements that came. Done after every round as well: unread, they
        would fill the socket's queue over a long wave, and the publisher would then drop the
        one that must wake this replica."""
        while self.sub.poll(0):
            self.heard = max(self.heard, int.from_bytes(self.sub.recv(), "little"))

    def announced(self, round_number: int) -> bool:
        """Whether round `round_number` was announced (none past the next can be: each
        replica announces a round only as it takes it)."""
        self.hear()
        return self.heard >= round_number

    def wait(self, socket: zmq.Socket[Any]) -> None:
        """Until `socket` (the scheduler's) has a message or a round is announced."""
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(self.sub, zmq.POLLIN)
        poller.poll()
