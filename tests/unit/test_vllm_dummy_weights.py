"""sweeps/vllm_dummy/: vLLM's dummy loader, imported in a process started with the folder first
on PYTHONPATH, fills weights as kvflow's dummy loader does. vLLM is not installed here: a
stand-in of its two modules as vLLM 0.26 lays them out (the fill functions in weight_utils,
imported by name into dummy_loader, whose loader fills each of the model's modules in turn)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WEIGHT_UTILS = """
def initialize_dummy_weights(model, model_config, low=-1e-3, high=1e-3, seed=1234):
    for tensor in model.state_dict().values():
        initialize_single_dummy_weight(tensor, low, high, seed)


def initialize_single_dummy_weight(tensor, low=-1e-3, high=1e-3, seed=1234):
    if tensor.device.type != "meta" and tensor.is_floating_point():
        tensor.copy_(tensor.float().uniform_(low, high).to(tensor.dtype))
"""

DUMMY_LOADER = """
from vllm.model_executor.model_loader.weight_utils import (
    initialize_dummy_weights,
    initialize_single_dummy_weight,
)


def load_weights(model, online):
    for layer in model.modules():
        if layer is online:
            for tensor in layer.state_dict().values():
                initialize_single_dummy_weight(tensor)
        else:
            initialize_dummy_weights(layer, None)
"""

CHECK = """
import torch
from vllm.model_executor.model_loader import dummy_loader

class RMSNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(64))

class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(256, 512, bias=False)
        self.norm = RMSNorm()
        self.register_buffer("_k_scale", torch.zeros(()))
        self.register_buffer("_q_scale", torch.zeros(()))
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("fp8", torch.zeros(64, 64, dtype=torch.float8_e4m3fn))
        self.register_buffer("later", torch.empty(8, 8, device="meta"))

model = torch.nn.Sequential(Attention(), torch.nn.Linear(128, 128, bias=False).bfloat16())
dummy_loader.load_weights(model, online=model[1])
attention = model[0]
assert abs(float(attention.qkv.weight.std()) - 0.02) < 1e-3, float(attention.qkv.weight.std())
assert bool((attention.norm.weight == 1).all())
assert float(attention._k_scale) == float(attention._q_scale) == 1.0
assert int(attention.steps.abs().sum()) == 0
assert 0.015 < float(attention.fp8.float().std()) < 0.025
assert attention.later.device.type == "meta"
assert 0.015 < float(model[1].weight.float().std()) < 0.025
print("patched")
"""


def test_vllms_dummy_loader_fills_as_kvflow_does(tmp_path: Path) -> None:
    package = tmp_path / "vllm" / "model_executor" / "model_loader"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "weight_utils.py").write_text(WEIGHT_UTILS)
    (package / "dummy_loader.py").write_text(DUMMY_LOADER)
    # a sitecustomize of the environment's, which the patch's own must not hide
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['HIDDEN_RAN'] = '1'\n")
    check = CHECK + "assert os.environ.get('HIDDEN_RAN') == '1'\n"
    paths = [str(ROOT / "sweeps" / "vllm_dummy"), str(tmp_path)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    done = subprocess.run(
        [sys.executable, "-c", "import os\n" + check],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "patched"
