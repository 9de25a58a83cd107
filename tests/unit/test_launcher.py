"""The supervisor's signal handling, with a real child process standing in for the frontend."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import pytest

from services.launcher.serve import Launcher
from shared.config import Config, ConfigError
from shared.replicas import replica_devices

FRONTEND_STAND_IN = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_sigterm_reaches_the_frontend_at_once() -> None:
    """The frontend refuses new work from the moment the signal arrives, not a beat later."""
    launcher = Launcher(Config())
    frontend = subprocess.Popen(
        [sys.executable, "-c", FRONTEND_STAND_IN], stdout=subprocess.PIPE, text=True
    )
    try:
        assert frontend.stdout is not None and frontend.stdout.readline() == "ready\n"
        launcher.procs["frontend"] = frontend
        launcher._on_signal(signal.SIGTERM, None)
        assert launcher.stopping
        assert frontend.wait(timeout=30) == 7  # its SIGTERM handler ran
    finally:
        frontend.kill()
        shutil.rmtree(launcher.runtime, ignore_errors=True)


def test_each_replica_gets_its_own_gpus_and_too_few_are_refused(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    launcher = Launcher(Config(device="cuda", data_parallel_size=2, tensor_parallel_size=2))
    shutil.rmtree(launcher.runtime, ignore_errors=True)
    assert [replica_devices(launcher.gpus, r, launcher.config) for r in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "3,5"},
        {"CUDA_VISIBLE_DEVICES": "6,7"},
    ]
    assert launcher.config.addresses("scheduler_address")[1].endswith("/scheduler-1")
    assert len(launcher.config.addresses("kv_events_address")) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ConfigError, match="needs 4 GPUs; 3 are visible"):
        Launcher(Config(device="cuda", data_parallel_size=2, tensor_parallel_size=2))
