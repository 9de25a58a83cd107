"""sweeps/vllm_dummy/: vLLM's dummy loader, imported in a process started with the folder first
on PYTHONPATH, fills weights as kvflow's dummy loader does. A stand-in for vLLM's module
(vLLM is not installed here) with its two fill functions and their signatures."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = """
def initialize_dummy_weights(model, model_config, low=-1e-3, high=1e-3, seed=1234):
    for tensor in model.state_dict().values():
        tensor.uniform_(low, high)


def initialize_single_dummy_weight(tensor, low=-1e-3, high=1e-3, seed=1234):
    tensor.uniform_(low, high)
"""

CHECK = """
import torch
from vllm.model_executor.model_loader import dummy_loader as loader

class RMSNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(64))

model = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False), RMSNorm())
model.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
loader.initialize_dummy_weights(model, None)
weight = model[0].weight
assert abs(float(weight.std()) - 0.02) < 1e-3, float(weight.std())
loader.initialize_dummy_weights(model[1], None)  # vLLM also fills each module by itself
assert bool((model[1].weight == 1).all())
assert int(model.steps.abs().sum()) == 0
online = torch.empty(128, 128, dtype=torch.bfloat16)
loader.initialize_single_dummy_weight(online)
assert 0.015 < float(online.float().std()) < 0.025
print("patched")
"""


def test_vllms_dummy_loader_fills_as_kvflow_does(tmp_path: Path) -> None:
    package = tmp_path / "vllm" / "model_executor" / "model_loader"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "dummy_loader.py").write_text(textwrap.dedent(STAND_IN))
    path = os.pathsep.join([str(ROOT / "sweeps" / "vllm_dummy"), str(tmp_path)])
    done = subprocess.run(
        [sys.executable, "-c", CHECK],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "patched"
