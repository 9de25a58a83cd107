"""The torch.distributed group an executor's rank joins: its replica's tensor-parallel ranks, or,
with expert parallelism across data-parallel replicas, every replica's ranks (N × T), within
which it takes part in three groups:

    tensor-parallel   its replica's T ranks (attention, dense layers: as without replicas)
    replica group     the rank of its tensor-parallel index in every replica (the mixture of
                      experts' token exchange: services/executor/parallel/replica_experts.py)
    rounds            every replica's first rank, on gloo (services/executor/parallel/lockstep.py)

The ranks meet through a file store in a folder: the tensor-parallel group's private one, or
the one all replicas share (`--data-parallel-group`, which `serve` and `LLM` make).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from services.executor.parallel.lockstep import Lockstep
from services.executor.parallel.replica_experts import ReplicaExperts
from services.executor.parallel.tensor_parallel import TensorParallel
from shared.config import Config
from shared.replicas import experts_across_replicas

logger = logging.getLogger(__name__)
TEARDOWN_S = 10  # how long ending the group may take before it is left behind


def join_world(
    config: Config, rank: int, group_dir: Path | None, device: torch.device
) -> TensorParallel:
    """Join the ranks' group as tensor-parallel rank `rank` of this replica, on `device` (NCCL
    on CUDA, gloo on CPU), met in `group_dir`, the tensor-parallel group's private folder; across
    replicas, every replica's ranks meet in --data-parallel-group instead."""
    size = config.tensor_parallel_size
    across = experts_across_replicas(config)
    replicas = config.data_parallel_size if across else 1
    store = Path(config.data_parallel_group) if across and config.data_parallel_group else None
    if across and store is None:
        raise ValueError("expert parallelism across replicas needs --data-parallel-group")
    store = store or group_dir
    if store is None:
        raise ValueError("a tensor-parallel group needs its folder")
    backend = _init(device, store, config.replica * size + rank, replicas * size)
    if not across:
        return TensorParallel(rank, size, expert_parallel=config.enable_expert_parallel)
    # Every rank makes every group, in the same order (torch.distributed's rule).
    tp_groups = [
        dist.new_group(_ranks(r * size, 1, size), backend=backend) for r in range(replicas)
    ]
    exchanges = [dist.new_group(_ranks(t, size, replicas), backend=backend) for t in range(size)]
    firsts = dist.new_group(_ranks(0, size, replicas), backend="gloo")
    lockstep = Lockstep(config.replica, replicas, firsts) if rank == 0 else None
    there = ReplicaExperts(config.replica, replicas, exchanges[rank], lockstep=lockstep)
    return TensorParallel(
        rank, size, tp_groups[config.replica], expert_parallel=True, replicas=there
    )


def _ranks(first: int, stride: int, count: int) -> list[int]:
    return [first + stride * index for index in range(count)]


def _init(device: torch.device, store: Path, rank: int, world: int) -> str:
    """torch.distributed's default group; the backend's name."""
    options: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options["device_id"] = device  # connect now, not at the first collective
    else:  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"file://{store}/store", rank=rank, world_size=world, **options
    )
    return backend


def leave_world() -> bool:
    """End this process's part of the group, unless it has none (any more): at exit, or when
    an `LLM` whose replicas share experts closes. A teardown that hangs (NCCL's can, with peers
    gone, or once CUDA graphs hold collectives: pytorch#115388) is left behind after TEARDOWN_S:
    whether it ended."""
    if not dist.is_initialized():
        return True
    done = threading.Event()

    def destroy() -> None:
        dist.destroy_process_group()
        done.set()

    threading.Thread(target=destroy, name="world-teardown", daemon=True).start()
    if not done.wait(TEARDOWN_S):
        logger.error("the ranks' group did not end in %d s; left behind", TEARDOWN_S)
        return False
    return True
