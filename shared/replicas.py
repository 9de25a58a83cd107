"""The names engine processes go by (heartbeats, /health, logs), over engine replicas
(--data-parallel-size) and tensor-parallel ranks (--tensor-parallel-size)."""

from __future__ import annotations

from shared.config import Config


def replica_name(component: str, replica: int, num_replicas: int) -> str:
    """ "scheduler", "executor-0" with one replica; "r1-scheduler", "r1-executor-0" (replica 1)
    with several."""
    return component if num_replicas == 1 else f"r{replica}-{component}"


def engine_component(component: str, config: Config) -> str:
    """This process's name: `component` of its replica (--data-parallel-rank)."""
    return replica_name(component, config.replica, config.data_parallel_size)


def engine_components(config: Config) -> list[str]:
    """Every engine process a frontend hears from: each replica's scheduler and executor ranks."""
    names = ["scheduler", *(f"executor-{t}" for t in range(config.tensor_parallel_size))]
    replicas = config.data_parallel_size
    return [replica_name(name, r, replicas) for r in range(replicas) for name in names]
