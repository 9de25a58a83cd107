"""Read a GGUF file's metadata (the llama.cpp architectures kvflow runs) as a Hugging Face
config.json dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shared.gguf_file import read_gguf

# GGUF key (after the "<arch>." prefix) -> config.json key
_ARCH_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
# Written by llama.cpp's converter for the families that have them
_FAMILY_KEYS = {
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "attention.sliding_window_pattern": "sliding_window_pattern",  # Gemma 3: every Nth full
    "rope.freq_base_swa": "rope_local_base_freq",  # Gemma 3's sliding layers
    "embedding_scale": "embedding_multiplier",  # Granite's multipliers
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
}
# GGUF architecture name -> transformers model_type
_FAMILIES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "olmo2": "olmo2",
    "granite": "granite",
}
# Gemma's 27B models scale scores by hidden / heads, not the head size: llama.cpp knows them
# by their layer count (the GGUF file has no query_pre_attn_scalar)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def read_fields(path: Path) -> dict[str, Any]:
    """All scalar and string metadata fields (arrays, such as the token lists, are skipped)."""
    file = read_gguf(path)
    out = {k: v for k, v in file.fields.items() if not isinstance(v, (list, np.ndarray))}
    out["_tensor_names"] = [t.name for t in file.tensors]
    out["_token_embd_rows"] = next(
        (int(t.shape[-1]) for t in file.tensors if t.name == "token_embd.weight"), None
    )
    # Rotary divisors per frequency as llama.cpp's converter stores them: Llama 3's long
    # context (rope_freqs), LongRoPE's two sets (Phi-3's rope_factors_short / _long)
    for name in ("rope_freqs", "rope_factors_short", "rope_factors_long"):
        data = next((t.data for t in file.tensors if t.name == f"{name}.weight"), None)
        out[f"_{name}"] = None if data is None else [float(f) for f in np.ravel(data)]
    return out


def read_gguf_config(path: Path) -> dict[str, Any]:
    fields = read_fields(path)
    arch = fields["general.architecture"]
    if arch not in _FAMILIES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported ({', '.join(_FAMILIES)})")
    cfg: dict[str, Any] = {"model_type": _FAMILIES[arch]}
    for key, hf_key in {**_ARCH_KEYS, **_FAMILY_KEYS}.items():
        if f"{arch}.{key}" in fields:
            cfg[hf_key] = fields[f"{arch}.{key}"]
    cfg.setdefault("vocab_size", fields["_token_embd_rows"])
    cfg["head_dim"] = fields.get(f"{arch}.attention.key_length") or (
        cfg["hidden_size"] // cfg["num_attention_heads"]
    )
    cfg["tie_word_embeddings"] = "output.weight" not in fields["_tensor_names"]
    cfg["attention_bias"] = "blk.0.attn_q.bias" in fields["_tensor_names"]
    cfg["eos_token_id"] = fields.get("tokenizer.ggml.eos_token_id")
    cfg["bos_token_id"] = fields.get("tokenizer.ggml.bos_token_id")
    return {**cfg, **_rope_scaling(fields, arch), **_gemma_scale(cfg, arch)}


def _rope_scaling(fields: dict[str, Any], arch: str) -> dict[str, Any]:
    """Linear rotary scaling (Gemma 3's global layers) where the file says so, or each
    frequency's divisor (`rope_freqs`: Llama 3.1's scaling, as llama.cpp stores it), or
    LongRoPE's two sets of them (Phi-3's long-context models)."""
    if fields["_rope_factors_long"] is not None:
        original = fields[f"{arch}.rope.scaling.original_context_length"]
        longrope = {
            "rope_type": "longrope",
            "long_factor": fields["_rope_factors_long"],
            "short_factor": fields["_rope_factors_short"],
            "original_max_position_embeddings": original,
            "attention_factor": fields.get(f"{arch}.rope.scaling.attn_factor"),
        }
        return {"rope_scaling": longrope, "original_max_position_embeddings": original}
    if fields["_rope_freqs"] is not None:
        return {"rope_scaling": {"rope_type": "factors", "factors": fields["_rope_freqs"]}}
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind != "linear":
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (linear)")
    factor = float(fields[f"{arch}.rope.scaling.factor"])
    return {"rope_scaling": {"rope_type": "linear", "factor": factor}}


def _gemma_scale(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Gemma's query_pre_attn_scalar as llama.cpp computes it: the head size, but hidden /
    heads for the 27B models."""
    if arch not in _GEMMA_27B_LAYERS:
        return {}
    if cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]:
        return {"query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"]}
    return {"query_pre_attn_scalar": cfg["head_dim"]}
