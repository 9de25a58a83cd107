"""vLLM's dummy weights drawn as kvflow draws its own (services/executor/loading/loader.py
`init_dummy`): norms at 1, every other float tensor normal with a deviation of 0.02.

vLLM fills every parameter uniformly in ±1e-3, each from the same seed. On Qwen3-30B-A3B in
FP8, its decode steps so built read a fraction of the expert weights that tokens spread over
the experts need (docs/benchmarks.md, mixture of experts); `sweeps/engine_vllm.py
--routing-report` says which experts they chose. `--dummy-weights normal` there puts this
folder first on PYTHONPATH, so that every process vLLM starts imports this file at startup
(and then the sitecustomize it hides, if any); it changes only the values the dummy loader
writes, not how vLLM computes with them. Meant for float checkpoints and online
quantization: every scale a layer holds (a KV cache's, a quantized checkpoint's) is set to 1.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

DUMMY_LOADER = "vllm.model_executor.model_loader.dummy_loader"
STD = 0.02


def _fill(name: str, tensor: Any, norm: bool) -> None:
    import torch

    if tensor.device.type == "meta" or not torch.is_floating_point(tensor):
        return  # as vLLM's: deferred (online quantization), or an integer table
    ones = norm or "norm" in name or "scale" in name
    with torch.no_grad():  # made in float32: FP8 tensors take neither randn nor fill
        make = torch.ones if ones else torch.randn
        values = make(tensor.shape, device=tensor.device, dtype=torch.float32)
        tensor.copy_((values if ones else values.mul_(STD)).to(tensor.dtype))


def initialize_dummy_weights(model: Any, model_config: Any = None, **_: Any) -> None:
    norm = "norm" in type(model).__name__.lower()  # a norm module's own "weight"
    for name, tensor in model.state_dict().items():
        _fill(name, tensor, norm)


def initialize_single_dummy_weight(tensor: Any, *_: Any, **__: Any) -> None:
    _fill("", tensor, norm=False)  # an online-quantized layer's weights


class _PatchDummyLoader(importlib.abc.MetaPathFinder):
    """Once vLLM's dummy loader is imported, its two fill functions are these."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != DUMMY_LOADER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        assert spec is not None and isinstance(spec.loader, importlib.abc.Loader)
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            module.initialize_dummy_weights = initialize_dummy_weights  # type: ignore[attr-defined]
            module.initialize_single_dummy_weight = initialize_single_dummy_weight  # type: ignore[attr-defined]

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    if DUMMY_LOADER in sys.modules:
        raise RuntimeError(f"{DUMMY_LOADER} was imported before the patch")
    if not any(isinstance(f, _PatchDummyLoader) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchDummyLoader())


def _chain() -> None:
    """Run the sitecustomize this one hides on the path (a distribution's, a bundle's)."""
    here = Path(__file__).resolve().parent
    for entry in sys.path:
        other = Path(entry or ".").resolve() / "sitecustomize.py"
        if other.parent != here and other.is_file():
            spec = importlib.util.spec_from_file_location("_hidden_sitecustomize", other)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


install()
if __name__ == "sitecustomize":  # imported at startup, not loaded by engine_vllm.py
    _chain()
