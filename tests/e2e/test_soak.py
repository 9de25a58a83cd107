"""The soak in CI: scripts/soak.py for 30 seconds of traffic (KVFLOW_SOAK_SECONDS sets another
length; scripts/soak.sh runs the 10-minute one).

Its own checks are the assertions: no leak, every request ended once as it should, resident
memory bounded, preemption and deadline expiry both exercised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECONDS = os.environ.get("KVFLOW_SOAK_SECONDS", "30")


def test_mixed_traffic_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "scripts/soak.py", "--duration", SECONDS, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.exists(), run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["checks"] == dict.fromkeys(result["checks"], True), result
    assert run.returncode == 0
    assert set(result["sent_by_scenario"]) >= {"stream", "n2", "cancel", "bad", "long", "deadline"}
