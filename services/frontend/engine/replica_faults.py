"""Engine replicas as failure domains (--data-parallel-size above 1, prefill/decode replicas
among them).

A replica with a component gone, exited or stuck fails only the requests placed on it: the
frontend tells its tokenizer workers which replicas are down (ReplicasDown), and each worker,
which knows where it placed every request, ends those on a replica newly down with an error and
places nothing more there. The other replicas' requests run on. /health still fails while a
replica is down (services/frontend/engine/health.py), so a supervisor restarts what died; under
`kvflow serve` the launcher lets the other replicas' requests finish first.

Pure: the engine client passes in the failing components it sees and sends what this says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from shared.config import Config
from shared.replicas import replica_of


class ReplicaFaults:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.exited: dict[str, str] = {}  # engine processes the launcher saw exit, and how
        self.down: dict[int, str] = {}  # replica -> why it is down, as last judged
        self._told: set[str] | None = None  # the workers told `down` (None: nothing to tell)

    def exit(self, component: str, exit_code: int) -> bool:
        """The launcher saw `component` exit; whether it is a replica's (else the whole
        engine is lost)."""
        if replica_of(component, self.config) is None or self.config.data_parallel_size == 1:
            return False
        self.exited[component] = f"{component} exited with code {exit_code}"
        return True

    def judge(self, failures: Mapping[str, str]) -> bool:
        """Take each failing component and why (gone, stuck, silent; those that exited are
        known here); whether the set of replicas down changed."""
        down: dict[int, str] = {}
        for name, why in sorted({**failures, **self.exited}.items()):
            replica = replica_of(name, self.config)
            if replica is not None:
                down.setdefault(replica, why)
        if down == self.down:
            return False
        self.down, self._told = down, set()
        return True

    def to_tell(self, workers: Iterable[str]) -> list[str]:
        """The workers that have not heard the replicas down since the set last changed:
        each is told once (a worker that joins later, when it first beats)."""
        if self._told is None:
            return []
        names = [name for name in workers if name not in self._told]
        self._told.update(names)
        return names
