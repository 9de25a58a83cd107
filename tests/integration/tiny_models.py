"""Tiny random-weight models of every supported family, and the prompts the parity tests use."""

from __future__ import annotations

import torch
import transformers

NUM_NEW_TOKENS = 64
# A tiny model's engine on CPU: its KV cache 64 MiB (8,000 of the parity models' blocks), not
# the CPU default of 1 GiB, which each of the suite's hundreds of tiny engines zeroed (0.4 s
# apiece) to hold a few hundred KiB of tokens.
TINY_ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=64 << 20)
PROMPT_LENGTHS = (3, 9, 16, 17, 30, 41, 57, 70)  # below, at and across block boundaries

TINY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)
FAMILIES = {
    "llama": (
        transformers.LlamaConfig,
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        ),
    ),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None, head_dim=16)),
    # Every layer in a window shorter than most prompts
    "mistral sliding": (transformers.MistralConfig, dict(sliding_window=12, head_dim=16)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    # Layer 0 full, layer 1 in a window (Qwen2's max_window_layers)
    "qwen2 sliding": (
        transformers.Qwen2Config,
        dict(use_sliding_window=True, sliding_window=20, max_window_layers=1),
    ),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32)),
    # Every multiplier away from 1, and tied embeddings, as Granite 3 publishes them
    "granite": (
        transformers.GraniteConfig,
        dict(
            embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
            logits_scaling=8.0, tie_word_embeddings=True,
        ),
    ),
    "olmo2": (transformers.Olmo2Config, dict(rms_norm_eps=1e-6)),
    # Gemma 3's text model: sandwich norms of 1 + w, GeGLU, sliding layers with their own
    # rotary base around full ones with a linear-scaled one
    "gemma3_text": (
        transformers.Gemma3TextConfig,
        dict(
            head_dim=16, sliding_window=12, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        ),
    ),
    # Gemma 2: Gemma 3's norms and GeGLU without q/k norms, every other layer in a window, and
    # scores and logits soft-capped, the caps low enough that tanh bends what tiny models make
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            head_dim=16, sliding_window=12, query_pre_attn_scalar=16,
            attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        ),
    ),
    # Fused qkv_proj and gate_up_proj in the checkpoint (Phi-3, Phi-4), a window on every layer
    "phi3": (transformers.Phi3Config, dict(sliding_window=20, pad_token_id=None)),
    # LongRoPE's two sets of frequencies: prompts longer than its original context of 32 take
    # the long set throughout, shorter ones cross into it as they generate
    "phi3 longrope": (
        transformers.Phi3Config,
        dict(
            pad_token_id=None, original_max_position_embeddings=32,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.1, 1.2, 1.5, 1.9, 2.4, 3.0, 3.7],
                "long_factor": [1.0, 1.3, 2.0, 3.1, 4.6, 6.5, 8.8, 11.5],
            },
        ),
    ),
    # YaRN's long-context rotary, past its original context of 32 within the prompts
    "qwen3 yarn": (
        transformers.Qwen3Config,
        dict(
            head_dim=32,
            rope_parameters={
                "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            },
        ),
    ),
}  # fmt: skip


def make_tiny_model(family: str) -> transformers.PreTrainedModel:
    """The family's tiny model, float32, random weights from seed 0."""
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **extra})
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab_size, (20,), generator=generator).tolist()
    prompts = []
    for i, length in enumerate(PROMPT_LENGTHS):
        ids = torch.randint(3, vocab_size, (length,), generator=generator).tolist()
        # Half the prompts share a 20-token prefix, so the prefix cache has work to do.
        prompts.append((shared + ids)[:length] if i % 2 else ids)
    return prompts


# Mixtures of experts (tests/integration/test_moe.py): few experts of few columns, two a token.
MOE_FAMILIES = {
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
    # The first layer dense, the experts' weights not renormalized (as Qwen1.5-MoE's are not)
    "qwen3_moe dense first": (
        transformers.Qwen3MoeConfig,
        dict(
            head_dim=32,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        ),
    ),
    # A shared expert under a sigmoid gate, and a qkv bias
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            norm_topk_prob=False,
        ),
    ),
    "mixtral": (
        transformers.MixtralConfig,
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, head_dim=16),
    ),
    # q and k normed over all heads at once, and q, k and v clamped (OLMoE's clip_qkv)
    "olmoe": (
        transformers.OlmoeConfig,
        dict(num_experts=6, num_experts_per_tok=2, intermediate_size=32, clip_qkv=1.0),
    ),
    # Attention sinks, biases on every projection, the router and the experts, a window on
    # alternate layers (0: sliding), YaRN, the clamped SwiGLU of interleaved gate/up columns
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(
            num_local_experts=6, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
            sliding_window=12,
            rope_parameters={
                "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
        ),
    ),
}  # fmt: skip
