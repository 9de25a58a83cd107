"""How an embedding model turns its prompt's hidden states into one vector, and whether a model
is one: read from its sentence-transformers files, else vLLM's defaults for decoder models.

The frontend, the offline `LLM` and the executor all read it; none of them needs torch for it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.model_config import ModelSource, resolve_model_source
from shared.protocol.base import require

POOLING_TYPES = ("last", "mean", "cls")

# sentence-transformers' 1_Pooling/config.json flags -> our pooling type
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_POOLING = "sentence_transformers.models.Pooling"


@dataclass(frozen=True)
class PoolingConfig:
    """`pooling_type`: which hidden states make the vector (last token, mean of all, first);
    `normalize`: scaled to unit length; `matryoshka`: the model allows `dimensions` (a
    truncated vector, renormalized), as its config says (`is_matryoshka` or
    `matryoshka_dimensions`)."""

    pooling_type: str = "last"  # vLLM's default for decoder embedding models
    normalize: bool = True
    matryoshka: bool = False
    num_dimensions: int | None = None  # the vector's length (hidden_size), where known


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _sentence_transformers(folder: Path) -> PoolingConfig | None:
    """The pooling of a folder's sentence-transformers modules (`modules.json`), or None."""
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        return None
    kinds = {m.get("type"): m.get("path", "") for m in modules if isinstance(m, dict)}
    pooling_type = "last"
    if _ST_POOLING in kinds:
        settings = _read_json(folder / kinds[_ST_POOLING] / "config.json") or {}
        chosen = [kind for flag, kind in _ST_MODES.items() if settings.get(flag)]
        if len(chosen) != 1:
            raise ValueError(
                f"{folder}: the pooling module sets {chosen or 'no'} modes; kvflow pools by "
                "exactly one of last token, mean and cls"
            )
        pooling_type = chosen[0]
    return PoolingConfig(pooling_type, normalize=_ST_NORMALIZE in kinds)


def load_pooling_config(source: ModelSource) -> PoolingConfig:
    """The model's pooling: its sentence-transformers files, else last token, normalized."""
    if source.format != "safetensors":
        return PoolingConfig()
    found = _sentence_transformers(source.path) or PoolingConfig()
    config = _read_json(source.path / "config.json") or {}
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    hidden = config.get("hidden_size")
    num_dimensions = hidden if isinstance(hidden, int) else None
    return PoolingConfig(found.pooling_type, found.normalize, matryoshka, num_dimensions)


def is_embedding_model(source: ModelSource) -> bool:
    """Whether `--task auto` serves the model as an embedding model: it has
    sentence-transformers modules, or its architecture is a bare `...Model` (a decoder without
    its language-model head, as `AutoModel` saves one) rather than `...ForCausalLM`."""
    if source.format != "safetensors":
        return False
    if (source.path / "modules.json").is_file():
        return True
    config = _read_json(source.path / "config.json") or {}
    architectures = config.get("architectures") or []
    return bool(architectures) and all(str(a).endswith("Model") for a in architectures)


def resolve_task(task: str, source: ModelSource) -> str:
    """`--task` resolved: "generate" or "embed" (auto: as the model's files say)."""
    if task in ("generate", "embed"):
        return task
    return "embed" if is_embedding_model(source) else "generate"


def served_pooling(task: str, model: str | None) -> PoolingConfig | None:
    """What a frontend serves: an embedding model's pooling, or None for a generate model. A
    frontend without the model's files (started alone) serves `--task embed` with defaults."""
    if task == "generate":
        return None
    try:
        source = resolve_model_source(model)
    except FileNotFoundError:
        return PoolingConfig() if task == "embed" else None
    return load_pooling_config(source) if resolve_task(task, source) == "embed" else None


def check_dimensions(dimensions: int | None, config: PoolingConfig) -> None:
    """Raise ParameterError (the `dimensions` field) unless the model gives vectors of
    `dimensions` values: its own length, or a shorter one of a Matryoshka model."""
    if dimensions is None or dimensions == config.num_dimensions:
        return
    require(config.matryoshka, "dimensions", "this model does not support shorter embeddings")
    top = config.num_dimensions
    require(dimensions >= 1, "dimensions", "must be >= 1")
    require(top is None or dimensions <= top, "dimensions", f"must be in [1, {top}]")


def shorten(vector: list[float], dimensions: int | None, config: PoolingConfig) -> list[float]:
    """The first `dimensions` values of an embedding, renormalized (a Matryoshka model's
    shorter embedding); the whole vector for None. Raises ParameterError (the `dimensions`
    field) where the model does not allow it or the number is out of range."""
    if dimensions is None or dimensions == len(vector):
        return vector
    check_dimensions(dimensions, dataclasses.replace(config, num_dimensions=len(vector)))
    head = vector[:dimensions]
    if not config.normalize:
        return head
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]
