"""Two replicas' first ranks taking rounds over gloo (services/executor/parallel/lockstep.py),
each in a process of its own: what tests/unit/test_lockstep.py runs."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist
import zmq

from services.executor.parallel.lockstep import Lockstep


def long_wave_then_a_launch(rank: int, directory: str, rounds: int) -> None:
    """Replica 1 launches `rounds` steps (a long wave), ends the wave with an idle round, then
    launches again at once; replica 0 serves it as an idle serving executor does
    (services/executor/process.py): a round whenever `due`, else asleep on its scheduler's
    socket and the announcements. Replica 0 exits with code 3 if it sleeps 10 s: the last
    launch's announcement was lost."""
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank,
                            world_size=2)  # fmt: skip
    lockstep = Lockstep(rank, 2, dist.new_group([0, 1], backend="gloo"))
    lockstep.open_wakes(Path(directory), 30.0)
    assert lockstep.wakes is not None
    scheduler = zmq.Context.instance().socket(zmq.PULL)
    scheduler.bind(f"ipc://{directory}/scheduler-{rank}")
    if rank == 1:
        for _ in range(rounds):
            lockstep.join(1, busy=True)
        lockstep.join(0, busy=False)
        lockstep.join(1, busy=True)
    else:
        while lockstep.rounds < rounds + 2:
            if lockstep.due():
                lockstep.join(0, busy=False)
                continue
            poller = zmq.Poller()
            poller.register(scheduler, zmq.POLLIN)
            poller.register(lockstep.wakes.sub, zmq.POLLIN)
            if not poller.poll(10_000):
                os._exit(3)
    dist.destroy_process_group()


if __name__ == "__main__":  # python -m tests.unit.lockstep_waves RANK DIRECTORY ROUNDS
    import sys

    long_wave_then_a_launch(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
