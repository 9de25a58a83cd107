"""Data-parallel replicas that exchange tokens in their mixture-of-experts layers
(services/executor/parallel/replica_experts.py) run their steps together: step k of one replica
meets step k of every other in each such layer's collectives. So every launch is a *round*:
each replica's first rank says how many rows its step has, and all learn the most (how many
rows each sends in the step's exchanges) and whether any replica still has work.

A replica with nothing to launch while others have work takes part anyway: it runs a step of
padding rows (`ModelRunner.idle_round`), which computes nothing of its own and only serves its
experts. A round in which no replica has work ends a *wave*: the replicas stop taking rounds
until one of them launches again.

The rounds are an all-reduce over a gloo group of the replicas' first ranks, on the host, before
each step is queued on the device; the step's own collectives then run on the device (NCCL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Round:
    padded: int  # the most rows any replica runs in this round (0: none runs any)
    busy: bool  # whether any replica has work still (else the wave ends here)


class Lockstep:
    """A replica's first rank's part in the rounds."""

    def __init__(self, replica: int, replicas: int, group: Any) -> None:
        """`group`: a gloo group of every replica's first rank."""
        self.replica = replica
        self.replicas = replicas
        self.group = group
        self.rounds = 0  # taken so far: the same count on every replica

    def join(self, rows: int, busy: bool) -> Round:
        """Take the next round with a step of `rows` rows (0: none, or padding only); `busy`:
        whether this replica has work still. Waits for every replica to join it."""
        values = torch.tensor([rows, int(busy)], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        self.rounds += 1
        return Round(int(values[0]), bool(values[1]))
