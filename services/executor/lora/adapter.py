"""A LoRA adapter in the PEFT format, read from disk and checked against the base model.

A PEFT adapter folder holds `adapter_config.json` and `adapter_model.safetensors`, whose
tensors are named like

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, in_features]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [out_features, r]

and the adapted projection computes W x + scaling * B (A x), with scaling = lora_alpha / r, or
lora_alpha / sqrt(r) for rsLoRA (`use_rslora`). kvflow takes adapters on any of the seven
projections of a decoder layer (q/k/v/o, gate/up/down, or Phi-3's fused qkv and gate_up), of
any rank up to --max-lora-rank. What
it cannot run as written is refused by name, never approximated: pickled weights
(`adapter_model.bin`), DoRA, trained biases, extra trained modules (`modules_to_save`),
per-module ranks or alphas, other targets (embeddings, lm_head), shapes that do not fit the
base model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from shared.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION + MLP
# Projections a checkpoint may store fused (Phi-3, Phi-4), and so an adapter may target: its
# A is each piece's, its B's rows are the pieces' in order (W x + B A x, cut by rows).
FUSED_TARGETS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)


def adaptable(cfg: ModelConfig, layer: int, target: str) -> bool:
    """Whether layer `layer` has projection `target` that LoRA can adapt: attention always, the
    MLP where it is dense (a mixture of experts' experts, router and shared expert take no
    LoRA yet)."""
    return target in ATTENTION or cfg.moe is None or layer not in cfg.moe.sparse_layers


class LoraAdapterError(ValueError):
    """An adapter kvflow cannot load, and why."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights, by (layer, projection): A [r, in] and B [out, r], float32 on the
    CPU (the executor copies them into its device slots), and the scale applied to B (A x)."""

    name: str
    path: Path
    rank: int
    scaling: float
    targets: tuple[str, ...]  # the projections it adapts, in TARGETS order
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def delta(self, layer: int, target: str) -> torch.Tensor | None:
        """scaling * B A [out, in]: what the adapter adds to the base weight."""
        if (layer, target) not in self.weights:
            return None
        a, b = self.weights[(layer, target)]
        return self.scaling * (b @ a)


def projection_shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(out_features, in_features) of a decoder layer's projection (a fused one's: its
    pieces' rows together)."""
    if target in FUSED_TARGETS:
        pieces = [projection_shape(cfg, piece) for piece in FUSED_TARGETS[target]]
        return sum(out for out, _ in pieces), pieces[0][1]
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "q_proj": (q, cfg.hidden_size),
        "k_proj": (kv, cfg.hidden_size),
        "v_proj": (kv, cfg.hidden_size),
        "o_proj": (cfg.hidden_size, q),
        "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
        "up_proj": (cfg.intermediate_size, cfg.hidden_size),
        "down_proj": (cfg.hidden_size, cfg.intermediate_size),
    }
    return shapes[target]


def load_lora_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check the adapter at `path` (a PEFT folder) for a base model of `cfg`."""
    try:
        return _load(name, Path(path), cfg, max_rank)
    except LoraAdapterError:
        raise
    except Exception as exc:  # a config of the wrong types, an unreadable folder, ...
        raise LoraAdapterError(
            f"LoRA adapter {name!r}: cannot read it: {type(exc).__name__}: {exc}"
        ) from exc


def _load(name: str, folder: Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    if not (folder / CONFIG_FILE).is_file():
        raise LoraAdapterError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {folder}")
    if not (folder / WEIGHTS_FILE).is_file():
        if (folder / PICKLED_WEIGHTS_FILE).is_file():
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: {PICKLED_WEIGHTS_FILE} is a pickle, which kvflow never "
                f"loads; save the adapter with safetensors (PEFT's default) as {WEIGHTS_FILE}"
            )
        raise LoraAdapterError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {folder}")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (json.JSONDecodeError, OSError, SafetensorError) as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: cannot read it: {exc}") from exc
    if not isinstance(config, dict):
        raise LoraAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    rank, scaling, listed_targets = _read_config(name, config, max_rank)
    weights = _read_weights(name, tensors, cfg, rank)
    if not weights:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    if listed_targets is not None:
        _check_coverage(name, config, cfg, listed_targets, set(weights))
    targets = tuple(t for t in TARGETS if any(key[1] == t for key in weights))
    return LoraAdapter(name, folder, rank, scaling, targets, weights)


def _check_coverage(
    name: str,
    config: dict[str, Any],
    cfg: ModelConfig,
    listed_targets: tuple[str, ...],
    found: set[tuple[int, str]],
) -> None:
    """The weights hold every listed projection on every layer the config names (PEFT: all
    layers where layers_to_transform is absent or empty): a truncated file is refused."""
    layers = _as_list(config.get("layers_to_transform") or []) or range(cfg.num_layers)
    expected = {
        (int(layer), target)
        for layer in layers
        for target in listed_targets
        if adaptable(cfg, int(layer), target)
    }
    if found != expected:
        differences = sorted(expected ^ found)[:3]
        raise LoraAdapterError(
            f"LoRA adapter {name!r}: its weights do not cover the layers and modules its config "
            f"names (target_modules, layers_to_transform); first differences: {differences}"
        )


# PEFT initialisations whose adapters only work on a base model PEFT changed with them, until
# converted (PEFT's path_initial_model_for_weight_conversion): refused as saved.
_CHANGES_THE_BASE = ("pissa", "olora", "corda", "loftq")


def _read_config(
    name: str, config: dict[str, Any], max_rank: int
) -> tuple[int, float, tuple[str, ...] | None]:
    """rank, scaling and the listed target projections from adapter_config.json (None where
    the config picks modules by a pattern or exclusions: the weights then say), or the
    refusal."""

    def refuse(why: str) -> LoraAdapterError:
        return LoraAdapterError(f"LoRA adapter {name!r}: {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise refuse(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise refuse(f"rank {rank} is over --max-lora-rank {max_rank}")
    for key, why in (
        ("use_dora", "DoRA is not supported"),
        ("rank_pattern", "per-module ranks (rank_pattern) are not supported"),
        ("alpha_pattern", "per-module alphas (alpha_pattern) are not supported"),
        ("modules_to_save", "extra trained modules (modules_to_save) are not supported"),
        ("fan_in_fan_out", "fan_in_fan_out weights (GPT-2's Conv1D) are not supported"),
        ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens) is not supported"),
    ):
        if config.get(key):
            raise refuse(why)
    if config.get("bias", "none") != "none":
        raise refuse(f"trained biases (bias={config['bias']!r}) are not supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_CHANGES_THE_BASE):
        raise refuse(
            f"init_lora_weights={init!r} needs the base model PEFT changed with it; convert "
            "the adapter to a plain LoRA (PEFT: path_initial_model_for_weight_conversion)"
        )
    alpha = config.get("lora_alpha", 8)  # PEFT's default
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise refuse(f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    target_modules = config.get("target_modules")
    if target_modules == "all-linear":  # PEFT: every linear layer but the output head
        return rank, float(scaling), TARGETS
    names = [str(n) for n in _as_list(target_modules)]
    if (
        isinstance(target_modules, str)
        or config.get("exclude_modules")
        or any(
            "." in n
            for n in names  # dotted names pick single modules, not every layer
        )
    ):
        return rank, float(scaling), None
    unknown = sorted(set(names) - set(TARGETS) - set(FUSED_TARGETS))
    if unknown or not names:
        known = list(TARGETS) + list(FUSED_TARGETS)
        raise refuse(f"target modules {unknown or names} are not among {known}")
    pieces = {piece for n in names for piece in FUSED_TARGETS.get(n, (n,))}
    return rank, float(scaling), tuple(t for t in TARGETS if t in pieces)


def _read_weights(
    name: str, tensors: dict[str, torch.Tensor], cfg: ModelConfig, rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, projection) -> (A, B), every name and shape checked."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _NAME.match(tensor_name)
        layer_and_target = (int(match[1]), match[2]) if match is not None else None
        if (
            cfg.moe is not None
            and ".mlp." in tensor_name
            and (layer_and_target is None or not adaptable(cfg, *layer_and_target))
        ):
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: {tensor_name} adapts a mixture of experts' layer "
                "(its experts, router or shared expert): LoRA on those is not supported yet, "
                "on its attention and dense MLP layers it is"
            )
        known = match is not None and (match[2] in TARGETS or match[2] in FUSED_TARGETS)
        if match is None or not known or int(match[1]) >= cfg.num_layers:
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: tensor {tensor_name!r} is not a LoRA weight of one of "
                f"the {cfg.num_layers} decoder layers' projections {list(TARGETS)}"
            )
        layer, target, half = int(match[1]), match[2], match[3]
        out_features, in_features = projection_shape(cfg, target)
        expected = (rank, in_features) if half == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: {tensor_name} is {tuple(tensor.shape)}, the base "
                f"model needs {expected} (rank {rank}): an adapter for another model?"
            )
        pair = pairs.setdefault((layer, target), {})
        if half in pair:  # e.g. lora_A.weight beside lora_A.default.weight
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: layer {layer}'s {target} has two lora_{half} tensors"
            )
        pair[half] = tensor.float()
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, target), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: layer {layer}'s {target} lacks lora_A or lora_B"
            )
        pieces = FUSED_TARGETS.get(target, (target,))
        rows = [projection_shape(cfg, piece)[0] for piece in pieces]
        for piece, b in zip(pieces, pair["B"].split(rows), strict=True):
            if (layer, piece) in weights:
                raise LoraAdapterError(
                    f"LoRA adapter {name!r}: layer {layer}'s {piece} is adapted twice (alone"
                    " and in a fused projection)"
                )
            weights[(layer, piece)] = (pair["A"], b.contiguous())
    return weights


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple | set) else [value]
