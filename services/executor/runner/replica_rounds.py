"""A runner's part in the rounds of expert parallelism across replicas
(services/executor/parallel/lockstep.py): each launch takes a round, and a replica with nothing
to launch while others run rows serves them with a step of padding rows.

With CUDA graphs, a graph's exchanges send the rows it was captured with, so every replica runs
a round's step at the same count: that of the smallest graph holding the most rows any replica
runs, a mixed step's graph if any replica's step is mixed (`StepGraphs.rows_for`). A replica
replays its graph of that count (a decode step's, or a mixed step's), or runs eagerly and pads
its rows to it in the exchange where it has none (a step past the graphs); its padding rows
choose no expert, as the replicas' rows on the device tell the graph when it replays."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from services.executor.parallel.lockstep import Round
from services.executor.parallel.tensor_parallel import TensorParallel
from services.executor.runner.cuda_graphs import StepGraphs
from services.executor.runner.plan_relay import PlanRelay
from services.executor.runner.step_buffers import PaddedShape, StepBuffers, StepView
from services.executor.runner.step_state import PreparedStep, RequestState
from shared.protocol import LaunchStep, PaddingStep


class RoundsTarget(Protocol):
    """What of services/executor/runner/model_runner.py's runner the rounds use."""

    tp: TensorParallel
    relay: PlanRelay | None
    buffers: StepBuffers
    graphs: StepGraphs | None
    row_owner: list[RequestState | None]

    def forward(self, view: StepView) -> torch.Tensor: ...

    def write_inputs(self, prepared: PreparedStep) -> None: ...


def refuse_drafts_across_replicas(tp: TensorParallel, speculates: bool) -> None:
    """Speculative decoding is not built for expert parallelism across replicas: its draft
    steps take no rounds."""
    if tp.replicas is not None and speculates:
        raise ValueError("--speculative-config: not built for expert parallelism across replicas")


def before_capture(
    tp: TensorParallel, device: torch.device
) -> Callable[[PaddedShape], None] | None:
    """Across replicas: each graph is captured with every replica's rows at its count (every
    replica captures the same graphs in the same order, their exchanges paired), and replays
    reading the replicas' rows from the device. None without replicas."""
    replicas = tp.replicas
    if replicas is None:
        return None
    replicas.step.keep_on_device(replicas.replicas, device)
    return lambda shape: replicas.step.set([shape.num_tokens] * replicas.replicas)


def launch_round(
    runner: RoundsTarget,
    prepared: PreparedStep,
    replica_rows: Sequence[int] = (),
    mixed: bool = False,
) -> None:
    """Before `prepared` is launched: rank 0 across replicas takes a round for it (the other
    ranks are given its outcome: `replica_rows`, each replica's rows, and whether a replica's
    step is `mixed`), relays the launch to the other ranks, and each rank's exchanges take the
    replicas' rows, the step padded to the round's graph where it has one; a plan of no rows
    then runs a step of padding rows if another replica runs rows."""
    replicas, rows = runner.tp.replicas, len(prepared.token_ids)
    if replicas is not None and replicas.lockstep is not None:
        own_mixed = max(prepared.counts, default=0) > 1
        taken = replicas.lockstep.join(rows, busy=True, mixed=own_mixed)
        replica_rows, mixed = taken.rows, taken.mixed
    if runner.relay is not None:
        runner.relay.send(LaunchStep(prepared.step, list(replica_rows), mixed))
    if replicas is None:
        return
    padded = _take_rows(runner, replica_rows, mixed)
    if rows:  # its inputs, left unwritten when prepared (ModelRunner._add_rows)
        graphs = runner.graphs
        prepared.shape = graphs.shape_at(padded, max(prepared.counts)) if graphs else None
        runner.write_inputs(prepared)
    elif max(replica_rows):
        _run_padding(runner, padded)


@torch.inference_mode()
def idle_round(runner: RoundsTarget, stop: bool = False) -> Round:
    """Rank 0 across replicas with nothing to launch: take the next round (`stop`: its work
    failed or was cancelled), running a step of padding rows if another replica runs rows."""
    replicas = runner.tp.replicas
    assert replicas is not None and replicas.lockstep is not None, "rank 0 across replicas"
    taken = replicas.lockstep.join(0, busy=False, stop=stop)
    if taken.padded:
        if runner.relay is not None:
            runner.relay.send(PaddingStep(list(taken.rows), taken.mixed))
        run_padding(runner, taken.rows, taken.mixed)
    return taken


@torch.inference_mode()
def run_padding(runner: RoundsTarget, replica_rows: Sequence[int], mixed: bool = False) -> None:
    """A step of padding rows alone, the replicas' rows in it being `replica_rows` (`mixed`:
    another replica's step is; a rank other than 0 told so by PaddingStep, or rank 0 in
    `idle_round`)."""
    _run_padding(runner, _take_rows(runner, replica_rows, mixed))


def _take_rows(runner: RoundsTarget, replica_rows: Sequence[int], mixed: bool) -> int:
    """The round's rows into the exchanges; returns the rows every replica runs in its step
    (the exchanges' count)."""
    replicas = runner.tp.replicas
    assert replicas is not None, "rounds are expert parallelism's across replicas"
    most = max(replica_rows)
    padded = runner.graphs.rows_for(most, mixed) if runner.graphs is not None else most
    replicas.step.set(replica_rows, padded)
    return padded


def _run_padding(runner: RoundsTarget, padded: int) -> None:
    """Padding rows alone (they read block 0 and write no KV), whose output is dropped: this
    replica's experts serve the other replicas' rows in the step's exchanges. The round's
    graph if there is one, else one row, eagerly."""
    graphs = runner.graphs
    shape = graphs.shape_at(padded, 0) if graphs is not None else None
    pad = shape or PaddedShape(num_tokens=1, num_reqs=1, max_query_len=1)
    runner.buffers.write([], [], [], [], pad)
    for row in range(pad.num_reqs):
        runner.row_owner[row] = None  # the padding rows overwrote their block-table rows
    runner.buffers.copy_to_device()
    if graphs is not None and shape is not None:
        graphs.replay(shape)
    else:
        runner.forward(runner.buffers.view(max_seq_len=1, max_query_len=1))
