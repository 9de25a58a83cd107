"""Write GGUF files of random weights in chosen GGUF types, with the `gguf` package (llama.cpp's
own writer): Llama-3.1-8B-shaped files for the GPU benchmarks, tiny ones for the tests.

Types the `gguf` package quantizes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, F32) are quantized
from normal weights; the K-quants (which it only dequantizes) get random blocks whose scale
fields are set so the weights have the requested spread around zero. Either way the file is
what llama.cpp would read; `python -m sweeps.gguf_writer --help` writes one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
# Per K-quant: where its f16 fields sit, and the offset (a multiple of d) that centres it.
_RANDOM_BLOCK_FIELDS = {
    "Q4_K": ((0, 2), 7.5),
    "Q5_K": ((0, 2), 15.5),
    "Q6_K": ((208,), 0.0),
    "Q3_K": ((108,), 0.0),
    "Q2_K": ((80, 82), 1.5),
}
# GGUF layer tensor -> our name for its place in a type mix
PIECES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# llama.cpp's Q4_K_M: Q4_K, with Q6_K for v and down (it alternates layers; all of them here).
Q4_K_M = {**dict.fromkeys(PIECES, "Q4_K"), "attn_v": "Q6_K", "ffn_down": "Q6_K"}


@dataclass(frozen=True)
class Shape:
    arch: str  # llama | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 500000.0
    context_length: int = 8192


LLAMA_8B = Shape("llama", 128256, 4096, 14336, 32, 32, 8, 128)


def random_weight(
    qtype: str, rows: int, k: int, std: float, rng: np.random.Generator
) -> np.ndarray:
    """[rows, row_bytes] uint8 in `qtype` (float types: [rows, k] of that dtype)."""
    if qtype in ("F32", "F16"):
        values = rng.standard_normal((rows, k), dtype=np.float32) * std
        return values.astype(np.float16 if qtype == "F16" else np.float32)
    if qtype not in _RANDOM_BLOCK_FIELDS:
        values = rng.standard_normal((rows, k), dtype=np.float32) * std
        return gguf.quants.quantize(values, QT[qtype])
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[QT[qtype]]
    raw = rng.integers(0, 256, (rows, k // block_elems, block_bytes), dtype=np.uint8)
    fields, offset = _RANDOM_BLOCK_FIELDS[qtype]
    _set_f16(raw, fields, 1.0, offset)
    sample = gguf.quants.dequantize(raw[: min(rows, 16)].reshape(min(rows, 16), -1), QT[qtype])
    scale = std / float(sample.std())
    _set_f16(raw, fields, scale, offset * scale)
    return raw.reshape(rows, -1)


def _set_f16(raw: np.ndarray, fields: tuple[int, ...], d: float, dmin: float) -> None:
    for at, value in zip(fields, (d, dmin)[: len(fields)], strict=True):
        raw[..., at : at + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)


def write_gguf(
    path: Path,
    shape: Shape,
    types: Callable[[int, str], str],  # (layer, piece) -> GGUF type name
    *,
    output_type: str | None = "Q6_K",  # None: the lm_head is tied to the embedding
    embedding_type: str = "Q4_K",
    seed: int = 0,
    std: float = 0.02,
) -> None:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_vocab_size(shape.vocab_size)

    def add(name: str, qtype: str, rows: int, k: int, scale: float = std) -> None:
        data = random_weight(qtype, rows, k, scale, rng)
        writer.add_tensor(name, data, raw_dtype=None if qtype in ("F32", "F16") else QT[qtype])

    h, q_rows = shape.hidden_size, shape.num_heads * shape.head_dim
    kv_rows = shape.num_kv_heads * shape.head_dim
    add("token_embd.weight", embedding_type, shape.vocab_size, h, 1.0)
    for layer in range(shape.num_layers):
        rows = {
            "attn_q": (q_rows, h),
            "attn_k": (kv_rows, h),
            "attn_v": (kv_rows, h),
            "attn_output": (h, q_rows),
            "ffn_gate": (shape.intermediate_size, h),
            "ffn_up": (shape.intermediate_size, h),
            "ffn_down": (h, shape.intermediate_size),
        }
        for piece, (n, k) in rows.items():
            add(f"blk.{layer}.{piece}.weight", types(layer, piece), n, k)
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(h, np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(h, np.float32))
        if shape.arch == "qwen3":
            for norm in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(shape.head_dim, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    if output_type is not None:
        add("output.weight", output_type, shape.vocab_size, h)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# transformers model_type -> GGUF architecture, for write_checkpoint
_ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "olmo2": gguf.MODEL_ARCH.OLMO2,
    "granite": gguf.MODEL_ARCH.GRANITE,
}
# Granite's multipliers, as llama.cpp's keys name them
_GRANITE_KEYS = {
    "embedding_multiplier": "embedding_scale",
    "residual_multiplier": "residual_scale",
    "attention_multiplier": "attention_scale",
    "logits_scaling": "logit_scale",
}


def write_checkpoint(path: Path, model: Any, projection_type: str = "F32") -> None:
    """A transformers model (float32) as llama.cpp's converter writes it: llama.cpp's tensor
    names (the `gguf` package's own map), Gemma's norms stored as 1 + w, Llama's q/k rows in
    llama.cpp's rotary order, and the metadata each family's converter writes; the layers'
    projections in `projection_type` (one the `gguf` package quantizes), the rest F32. What
    kvflow reads of the families whose GGUF files llama.cpp publishes."""
    cfg = model.config
    family = cfg.model_type
    arch = _ARCHS[family]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _write_metadata(writer, cfg)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if family.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's Gemma norms multiply by the weight alone
        rope_rows = hf_name.endswith(("q_proj.weight", "k_proj.weight"))
        if family in ("llama", "granite") and rope_rows:  # llama.cpp's LlamaModel permutes
            heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            data = _permute_rope(data, heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        data = np.ascontiguousarray(data, dtype=np.float32)
        if projection_type != "F32" and hf_name.endswith("_proj.weight"):
            qtype = QT[projection_type]
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    rope = _rope_of(cfg)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg, rope))
    if rope.get("rope_type") == "longrope":  # Phi-3's long context: both sets of divisors
        for name in ("long", "short"):
            factors = np.asarray(rope[f"{name}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{name}.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama3_rope_freqs(cfg: Any, rope: dict[str, Any]) -> np.ndarray:
    """Llama 3's long-context rotary as llama.cpp's converter stores it: the divisor of each
    frequency (1 for short wavelengths, `factor` for long ones, blended between)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    old, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    wavelen = 2 * math.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blended)
    ).astype(np.float32)


def _write_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    rope = _rope_of(cfg)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "longrope":  # as llama.cpp's Phi-3 converter computes it
        original = cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key, None):
            getattr(writer, f"add_{key}")(getattr(cfg, key))
    for key, name in _GRANITE_KEYS.items():
        if cfg.model_type == "granite":
            getattr(writer, f"add_{name}")(getattr(cfg, key))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(getattr(cfg, key, None), int):
            getattr(writer, f"add_{key}")(getattr(cfg, key))


def _rope_of(cfg: Any) -> dict[str, Any]:
    """The config's rotary parameters (Gemma 3's: its full layers')."""
    rope: dict[str, Any] = cfg.rope_parameters
    return rope.get("full_attention", rope)


def _permute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's rotate-half rows (2, pairs) as (pairs, 2)."""
    pairs = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, 2, pairs, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--type", default="Q4_K_M", help="Q4_K_M, or one GGUF type for all")
    parser.add_argument("--layers", type=int, default=LLAMA_8B.num_layers)
    args = parser.parse_args()
    shape = dataclasses.replace(LLAMA_8B, num_layers=args.layers)
    mix = Q4_K_M if args.type == "Q4_K_M" else dict.fromkeys(PIECES, args.type)
    write_gguf(args.path, shape, lambda _layer, piece: mix[piece])
    print(f"wrote {args.path} ({args.path.stat().st_size / 2**30:.2f} GiB, {args.type})")


if __name__ == "__main__":
    main()
