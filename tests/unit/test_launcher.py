"""The supervisor's signal handling, with a real child process standing in for the frontend."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

from services.launcher.serve import Launcher
from shared.config import Config

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
