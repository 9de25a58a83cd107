"""A runner's part in the rounds of expert parallelism across replicas
(services/executor/parallel/lockstep.py): each launch takes a round, and a replica with nothing
to launch while others run rows serves them with a step of padding rows."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from services.executor.parallel.lockstep import Round
from services.executor.parallel.tensor_parallel import TensorParallel
from services.executor.runner.plan_relay import PlanRelay
from services.executor.runner.step_buffers import PaddedShape, StepBuffers, StepView
from services.executor.runner.step_state import RequestState
from shared.protocol import LaunchStep, PaddingStep

logger = logging.getLogger(__name__)


class RoundsTarget(Protocol):
    """What of services/executor/runner/model_runner.py's runner the rounds use."""

    tp: TensorParallel
    relay: PlanRelay | None
    buffers: StepBuffers
    row_owner: list[RequestState | None]

    def forward(self, view: StepView) -> torch.Tensor: ...


def graphs_allowed(tp: TensorParallel, speculates: bool) -> bool:
    """Whether the runner may capture CUDA graphs: not across replicas, whose graphs' exchanges
    would have to send rows padded alike on every replica (not built yet: eager steps). There,
    speculative decoding is refused (its draft steps take no rounds)."""
    if tp.replicas is None:
        return True
    if speculates:
        raise ValueError("--speculative-config: not built for expert parallelism across replicas")
    logger.info("expert parallelism across replicas: steps run eagerly (no CUDA graphs)")
    return False


def launch_round(
    runner: RoundsTarget, step: int, rows: int, replica_rows: Sequence[int] = ()
) -> None:
    """Before plan `step` (of `rows` rows) is launched: rank 0 across replicas takes a round
    for it (the other ranks are given its outcome, `replica_rows`: each replica's rows), relays
    the launch to the other ranks, and each rank's exchanges take the replicas' rows; a plan of
    no rows then runs a step of padding rows if another replica runs rows."""
    replicas = runner.tp.replicas
    if replicas is not None and replicas.lockstep is not None:
        replica_rows = replicas.lockstep.join(rows, busy=True).rows
    if runner.relay is not None:
        runner.relay.send(LaunchStep(step, list(replica_rows)))
    if replicas is not None:
        replicas.step.set(replica_rows)
        if not rows and max(replica_rows):
            _run_padding(runner)


@torch.inference_mode()
def idle_round(runner: RoundsTarget, stop: bool = False) -> Round:
    """Rank 0 across replicas with nothing to launch: take the next round (`stop`: its work
    failed or was cancelled), running a step of padding rows if another replica runs rows."""
    replicas = runner.tp.replicas
    assert replicas is not None and replicas.lockstep is not None, "rank 0 across replicas"
    taken = replicas.lockstep.join(0, busy=False, stop=stop)
    if taken.padded:
        if runner.relay is not None:
            runner.relay.send(PaddingStep(list(taken.rows)))
        run_padding(runner, taken.rows)
    return taken


@torch.inference_mode()
def run_padding(runner: RoundsTarget, replica_rows: Sequence[int]) -> None:
    """A step of padding rows alone, the replicas' rows in it being `replica_rows` (a rank
    other than 0 told so by PaddingStep, or rank 0 in `idle_round`)."""
    assert runner.tp.replicas is not None, "padding steps are expert parallelism's"
    runner.tp.replicas.step.set(replica_rows)
    _run_padding(runner)


def _run_padding(runner: RoundsTarget) -> None:
    """One padding row (it reads block 0 and writes no KV), whose output is dropped: this
    replica's experts serve the other replicas' rows in the step's exchanges."""
    runner.buffers.write([], [], [], [], PaddedShape(num_tokens=1, num_reqs=1, max_query_len=1))
    runner.row_owner[0] = None  # the padding row overwrote its block-table row
    runner.buffers.copy_to_device()
    runner.forward(runner.buffers.view(max_seq_len=1, max_query_len=1))
