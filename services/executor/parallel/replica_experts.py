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
services/executor/parallel/lockstep.py), or further, to the CUDA graph every replica replays for
that count (services/executor/runner/replica_rounds.py). Every replica must so run each step's
layers together: one with nothing to run takes part with a step of padding rows. Padding rows
choose no expert (else they would all go to the same few, whose ranks would compute them).
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
    padded_to: int = 0  # the rows each replica sends, where more than the most any has
    # With CUDA graphs, the rows on the device, which a graph's padding mask is made from when
    # it replays (`keep_on_device`); without, the mask is made from the host's rows.
    on_device: torch.Tensor | None = None  # [replicas] int64
    _padding: torch.Tensor | None = None  # `padding`'s mask, made once a step

    def keep_on_device(self, replicas: int, device: torch.device) -> None:
        if self.on_device is None:
            self.on_device = torch.zeros(replicas, dtype=torch.int64, device=device)

    def set(self, rows: Sequence[int], padded_to: int = 0) -> None:
        self.rows, self.padded_to, self._padding = tuple(rows), padded_to, None
        if self.on_device is not None:  # queued before the step: a graph reads it at replay
            host = torch.tensor(self.rows, pin_memory=self.on_device.device.type == "cuda")
            self.on_device.copy_(host, non_blocking=True)

    @property
    def padded(self) -> int | None:
        """The rows each replica sends: the most any has, or `padded_to`."""
        return max(*self.rows, self.padded_to) if self.rows is not None else None

    def padding(self, device: torch.device) -> torch.Tensor | None:  # [replicas, P] bool
        """Which of the gathered rows are padding (None: none is, every replica running as
        many rows, without graphs), made on the device once a step rather than in each layer.
        A graph must make it in its capture (`set` before it), else it would replay a mask
        made before and freed since."""
        padded = self.padded
        if padded is None or (self.on_device is None and min(self.rows or ()) == padded):
            return None
        if self._padding is None or self._padding.device != device:
            self._padding = torch.arange(padded, device=device) >= self._rows(device)[:, None]
        return self._padding

    def _rows(self, device: torch.device) -> torch.Tensor:  # [replicas]
        if self.on_device is not None:
            return self.on_device
        # From pinned memory without waiting: a pageable copy would wait for the device to
        # finish the work queued before it, each step.
        host = torch.tensor(self.rows, pin_memory=device.type == "cuda")
        return host.to(device, non_blocking=True)


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
