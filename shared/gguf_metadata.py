"""Read a llama-architecture GGUF file's metadata as a Hugging Face config.json dict."""

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
# GGUF architecture name -> transformers model_type
_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def read_fields(path: Path) -> dict[str, Any]:
    """All scalar and string metadata fields (arrays, such as the token lists, are skipped)."""
    file = read_gguf(path)
    out = {k: v for k, v in file.fields.items() if not isinstance(v, (list, np.ndarray))}
    out["_tensor_names"] = [t.name for t in file.tensors]
    out["_token_embd_rows"] = next(
        (int(t.shape[-1]) for t in file.tensors if t.name == "token_embd.weight"), None
    )
    return out


def read_gguf_config(path: Path) -> dict[str, Any]:
    fields = read_fields(path)
    arch = fields["general.architecture"]
    if arch not in _FAMILIES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported ({', '.join(_FAMILIES)})")
    cfg: dict[str, Any] = {"model_type": _FAMILIES[arch]}
    for key, hf_key in _ARCH_KEYS.items():
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
    return cfg
