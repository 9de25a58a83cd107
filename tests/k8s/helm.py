"""The helm binaries the chart tests run under, one for each major version: the chart must
render and lint under Helm 3 and Helm 4 alike, which read values differently (Helm 3.18.0 reads
the chart's own numbers as json.Number strings, Helm 4 as numbers).

`bash scripts/helm.sh 3` and `bash scripts/helm.sh 4` install them as $KVFLOW_TOOLS/helm3 and
helm4; a `helm` on PATH stands in for its own major version where that is missing.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

MAJORS = ("3", "4")

_current: str | None = None


def tools() -> Path:
    return Path(os.environ.get("KVFLOW_TOOLS", Path.home() / ".cache/kvflow/tools"))


def major_version(binary: str) -> str | None:
    """`helm version --short` says e.g. v3.18.0+gcc58e3f: "3"."""
    try:
        out = subprocess.run(
            [binary, "version", "--short"], capture_output=True, text=True, timeout=60
        )
    except OSError:
        return None
    version = out.stdout.strip()
    return version[1:].split(".")[0] if out.returncode == 0 and version[:1] == "v" else None


@functools.cache
def installed() -> dict[str, str]:
    """Each major version's binary, by major version ("3", "4"); absent ones are left out."""
    candidates = [str(tools() / f"helm{major}") for major in MAJORS]
    candidates.append(shutil.which("helm") or "")
    found: dict[str, str] = {}
    for binary in candidates:
        if binary and Path(binary).is_file():
            major = major_version(binary)
            if major in MAJORS:
                found.setdefault(major, binary)
    return found


def use(binary: str | None) -> None:
    """The binary that `current()` gives the tests, until the next call."""
    global _current
    _current = binary


def current() -> str:
    assert _current is not None, "no helm chosen: tests/k8s/conftest.py's fixture chooses one"
    return _current
