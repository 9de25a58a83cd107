"""CUDA graphs' padding on the CPU: each step padded to the shape a graph would replay and run
eagerly (`PaddedEagerly`), where the CPU has no graphs. A test sets it on a runner it holds, or
puts `padded_graphs_hook` first on the PYTHONPATH of the processes an engine starts (the
data-parallel replicas, their ranks): each then builds its runners' graphs as PaddedEagerly, and
with PADDED_GRAPHS_LOG set each replay appends its token count (and the rows the replicas'
exchanges sent in it) to a file of that folder."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from services.executor.runner import model_runner
from services.executor.runner.cuda_graphs import StepGraphs
from services.executor.runner.step_buffers import PaddedShape

HOOK = Path(__file__).parent / "padded_graphs_hook"
LOG = "PADDED_GRAPHS_LOG"  # not KVFLOW_: tp_generate passes none of those on


class PaddedEagerly(StepGraphs):
    """A CUDA graph's padding without the graph: each step is padded to the shape a graph
    would replay (padding rows that draft nothing and read block 0) and run eagerly."""

    replays = 0

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return True

    def capture(self) -> None:
        """Nothing to capture: replays run the forward pass at their shape."""

    def replay(self, shape: PaddedShape) -> torch.Tensor:
        self.replays += 1
        if folder := os.environ.get(LOG):
            with open(Path(folder) / f"{os.getpid()}.log", "a") as log:
                log.write(f"{shape.num_tokens} {self._rows_agreed() or shape.num_tokens}\n")
        return self.forward(self.buffers.view(self.max_seq_len, shape.max_query_len))

    def _rows_agreed(self) -> int | None:
        """Across replicas, the rows the step's exchanges send, which a graph's are fixed to:
        those it was captured with, its token count."""
        runner = getattr(self.forward, "__self__", None)  # a proposer's has no replicas
        replicas = getattr(getattr(runner, "tp", None), "replicas", None)
        return replicas.step.padded if replicas is not None else None


def install() -> None:
    """Every runner this process builds from now on pads its steps as graphs would."""
    model_runner.StepGraphs = PaddedEagerly  # type: ignore[misc]


def environment(log: Path) -> dict[str, str]:
    """The variables that make the processes an engine starts pad like graphs (the repository
    on their path, for the hook's import), each replay logged in `log`."""
    path = [str(HOOK), str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, path)), LOG: str(log)}


def replayed(log: Path) -> list[tuple[int, int]]:
    """The replays logged in `log` by every process: each one's token count, and the rows the
    replicas' exchanges sent in it (a graph's token count, where it runs right)."""
    lines = [line for path in log.glob("*.log") for line in path.read_text().splitlines()]
    return [(int(tokens), int(rows)) for tokens, rows in map(str.split, lines)]
