"""Expert parallelism across data-parallel replicas (`--data-parallel-size N
--enable-expert-parallel`): attention stays data parallel, each replica running its own
requests, while a mixture of experts' experts spread over all N × T ranks (T: the tensor-parallel
size), an (N T)th of them each.

A mixture-of-experts layer then exchanges its tokens between the replicas: the ranks of one
tensor-parallel index t in every replica (the "replica group") gather their replicas' tokens,
each runs its own experts over all of them, and the sums go back to the replicas they came from
(a reduce-scatter); the tensor-parallel all-reduce after the block adds the T ranks' experts
within a replica, as it adds a dense MLP's parts.

    replica 0 (tokens a)  ─┐  all-gather  [a; b] ─ rank's experts ─ reduce-scatter ─> a's sums
    replica 1 (tokens b)  ─┘                                                      ─> b's sums

The gather takes the same count of rows from each replica: a step's rows padded to the most any
replica has in that step (the replicas tell each other their rows before they launch it:
services/executor/parallel/lockstep.py). Every replica must so run each step's layers together:
one with nothing to run takes part with a step of padding rows. Padding rows choose no expert
(else they would all go to the same few, whose ranks would compute them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from services.executor.parallel.lockstep import Lockstep


@dataclass
class StepRows:
    """Each replica's rows in the step being run, set by the runner before it runs a step
    (`set`). None: the step's own, alike on every replica (the profiling step at start)."""

    rows: tuple[int, ...] | None = None
    _padding: torch.Tensor | None = None  # `padding`'s mask, made once a step

    def set(self, rows: Sequence[int]) -> None:
        self.rows, self._padding = tuple(rows), None

    @property
    def padded(self) -> int | None:
        """The rows each replica sends: the most any has."""
        return max(self.rows) if self.rows is not None else None

    def padding(self, device: torch.device) -> torch.Tensor | None:  # [replicas, P] bool
        """Which of the gathered rows are padding (None: none is, every replica running as
        many rows), made on the device once a step rather than in each layer."""
        if self.rows is None or min(self.rows) == max(self.rows):
            return None
        if self._padding is None or self._padding.device != device:
            # From pinned memory without waiting: a pageable copy would wait for the device
            # to finish the work queued before it, each step.
            host = torch.tensor(self.rows, pin_memory=device.type == "cuda")
            rows = host.to(device, non_blocking=True)
            self._padding = torch.arange(max(self.rows), device=device) >= rows[:, None]
        return self._padding


@dataclass(frozen=True)
class ReplicaExperts:
    """This rank's place among the replicas' ranks of its tensor-parallel index."""

    replica: int  # this rank's replica
    replicas: int  # how many
    group: Any  # a torch.distributed group: this tensor-parallel index's rank in every replica
    lockstep: Lockstep | None = None  # the replica's first rank's part in the rounds
    step: StepRows = field(default_factory=StepRows)

    def gather(self, x: torch.Tensor) -> torch.Tensor:  # [replicas × P, cols]
        """Every replica's rows of x [rows, cols], each padded to the step's P rows, stacked
        in replica order."""
        padded = self.step.padded or x.shape[0]
        if padded < x.shape[0]:
            raise RuntimeError(f"a step of {x.shape[0]} rows where the replicas agreed {padded}")
        rows = x.new_zeros(padded, x.shape[1])
        rows[: x.shape[0]] = x
        if _uses_gloo(self.group):  # gloo has no all_gather_into_tensor
            parts = [torch.empty_like(rows) for _ in range(self.replicas)]
            dist.all_gather(parts, rows, group=self.group)
            return torch.cat(parts)
        out = rows.new_empty(self.replicas * padded, x.shape[1])
        dist.all_gather_into_tensor(out, rows, group=self.group)
        return out

    def padding(self, gathered: torch.Tensor) -> torch.Tensor | None:  # [replicas × P] bool
        """Which of the gathered rows are padding (None: all are the replicas' own)."""
        return self.step.padding(gathered.device)

    def own_rows(self, gathered: torch.Tensor, rows: int) -> torch.Tensor:
        """This replica's `rows` of the gathered rows' layout (which rows are its own)."""
        padded = gathered.shape[0] // self.replicas
        return gathered[self.replica * padded : self.replica * padded + rows]

    def scatter_sum(self, out: torch.Tensor, rows: int) -> torch.Tensor:  # [rows, cols]
        """The replicas' `out` [replicas × P, cols] added up, this replica's first `rows` of
        its P: a reduce-scatter (gloo, which has none: an all-reduce of all of it)."""
        padded = out.shape[0] // self.replicas
        if _uses_gloo(self.group):
            dist.all_reduce(out, group=self.group)
            return self.own_rows(out, rows).clone()
        mine = out.new_empty(padded, out.shape[1])
        dist.reduce_scatter_tensor(mine, out.contiguous(), group=self.group)
        return mine[:rows]


def _uses_gloo(group: Any) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO
