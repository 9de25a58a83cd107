"""The CPU image (docker/build.sh) ships torch without Triton: every process must start there.

Triton kernels are imported only for CUDA tensors (`kernels.ops`); a module-level import of a
`kernels.triton_*` module anywhere on a process's import path would crash that process on
the CPU image, as a warm-up constant once did (the compose tests caught it, 40 minutes in).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROCESS_MODULES = [
    "services.executor.process",
    "services.scheduler.process",
    "services.frontend.process",
    "services.tokenizer.process",
    "services.launcher.serve",
    "kvflow",
]


def test_every_process_imports_without_triton() -> None:
    blocked = "import sys; sys.modules['triton'] = None  # import triton now raises\n"
    code = blocked + "".join(f"import {module}\n" for module in PROCESS_MODULES)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
