"""Expert parallelism across replicas, its rounds (services/executor/parallel/lockstep.py) over
gloo between two processes: after a wave long enough to fill a socket's queue with the
announcements an executor busy in the wave never needed, an idle replica still hears the one
that must wake it (tests/unit/lockstep_waves.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_an_idle_replica_is_woken_after_a_long_wave(tmp_path: Path) -> None:
    rounds = 6000  # each subscriber's queue holds about 4,000 announcements
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    argv = [sys.executable, "-m", "tests.unit.lockstep_waves"]
    procs = [
        subprocess.Popen([*argv, str(rank), str(tmp_path), str(rounds)], cwd=ROOT, env=env)
        for rank in (0, 1)
    ]
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=240))
        finally:
            if proc.poll() is None:
                proc.kill()
    assert codes[0] != 3, "replica 0 slept through replica 1's launch: its wake was lost"
    assert codes == [0, 0]
