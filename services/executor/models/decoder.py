"""The decoder-only transformer shared by Llama, Mistral, Qwen2, Qwen3, Granite and OLMo 2, and
by the mixtures of experts built like them (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, gpt-oss).

The families differ only in switches read from ModelConfig: a bias on the qkv projection
(Qwen2), an RMSNorm on each head of q and k (Qwen3) or on all heads at once (OLMoE, OLMo 2),
Llama 3's RoPE scaling, tied embeddings, Granite's multipliers, OLMo 2's norms after each
sublayer instead of before, and experts in place of the MLP (layers/moe.py). Weights load
from Hugging Face names: `checkpoint_param` maps each to the parameter it fills
(services/executor/loading/weights.py walks the checkpoint). Under tensor parallelism a rank
builds the layers of its part (services/executor/parallel/tensor_parallel.py), and each layer's
parameters take their part of each weight.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kernels import ops
from services.executor.layers.attention_metadata import AttentionMetadata
from services.executor.layers.embedding import VocabParallelEmbedding
from services.executor.layers.linear import Activation, Linear, LinearMethod
from services.executor.layers.lora import LoraTokens
from services.executor.layers.mlp import GatedMLP
from services.executor.layers.moe import ExpertsMethod, SparseMoE, expert_piece
from services.executor.layers.norm import RMSNorm
from services.executor.layers.rotary import LongRope, RotaryEmbedding
from services.executor.layers.weight_loader import copy_weight, set_weight_loader, unpacked
from services.executor.parallel.layout import ShardLayout, experts_of_rank
from services.executor.parallel.shards import CheckpointTensor, read
from services.executor.parallel.tensor_parallel import ONE_RANK, TensorParallel
from services.executor.quantization.methods import experts_method
from shared.model_config import ModelConfig

# Older llm-compressor / AutoFP8 names of an FP8 KV cache's scales -> today's
_KV_SCALE_NAMES = {".k_proj.output_scale": ".k_scale", ".v_proj.output_scale": ".v_scale"}
# The tensors of an image and text model that only its image part reads (Gemma 3's)
_OTHER_MODALITIES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.")  # fmt: skip
# HF parameter name piece -> (our fused parameter, shard index within it)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def hf_module_names(name: str) -> list[str]:
    """The Hugging Face modules one of our modules holds: q/k/v for a qkv_proj, gate/up for a
    gate_up_proj, else itself (names without the "model." prefix)."""
    parent, _, leaf = name.rpartition(".")
    pieces = [piece for piece, (fused, _) in _STACKED.items() if fused == leaf]
    return [f"{parent}.{piece}" for piece in pieces] or [name]


class Attention(nn.Module):
    def __init__(
        self,
        layout: ShardLayout,
        rotary: RotaryEmbedding,
        method: LinearMethod | None,
        kv_scales: bool = False,
        input_size: int | None = None,
        window: int | None = None,
    ) -> None:
        """`layout`: what this rank holds of the model (all of it on one rank); `input_size`:
        of the qkv projection's input, the hidden size unless given (an EAGLE-3 head reads
        an embedding and a hidden state side by side); `window`: a sliding layer's window
        (a query sees its own position and the window - 1 before), None: the whole context."""
        super().__init__()
        cfg = layout.local_config
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        qkv_size = self.q_size + 2 * self.kv_size
        qkv = layout.qkv_parallel()
        in_size = input_size or cfg.hidden_size
        self.qkv_proj = Linear(in_size, qkv_size, cfg.attention_bias, method, sharding=qkv)
        o = layout.row_parallel(cfg.hidden_size)  # its inputs: the rank's heads' outputs
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.output_bias, method, sharding=o)
        # q_norm and k_norm: per head (Qwen3), fused in the rotary kernel; or over all heads
        # at once (OLMoE), before it
        self.norm_whole = cfg.qk_norm_whole
        norm_sizes = (self.q_size, self.kv_size) if self.norm_whole else (cfg.head_dim,) * 2
        normed = cfg.qk_norm or self.norm_whole
        self.q_norm = RMSNorm(norm_sizes[0], cfg.rms_norm_eps) if normed else None
        self.k_norm = RMSNorm(norm_sizes[1], cfg.rms_norm_eps) if normed else None
        self.clip_qkv = cfg.clip_qkv
        self.rotary = rotary
        self.eps = cfg.rms_norm_eps  # of q_norm / k_norm
        self.scale = cfg.attention_multiplier or cfg.head_dim**-0.5
        self.window = window
        self.kv_group = 0  # its layer group's block table (shared/kv_groups.py; set_kv_groups)
        self.softcap = cfg.attn_logit_softcapping  # Gemma 2's
        # gpt-oss: a sink logit for each of the rank's query heads (its share of the softmax)
        self.sinks: nn.Parameter | None = None
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(cfg.num_heads, dtype=torch.float32),
                                      requires_grad=False)  # fmt: skip
            first_head = layout.tp.rank * cfg.num_heads
            set_weight_loader(self.sinks, functools.partial(_load_heads, first=first_head))
        # An FP8 cache holds key / k_scale and value / v_scale: 1.0 unless the checkpoint
        # calibrated them (`kv_scales`: loaded as k_scale and v_scale, read by prepare_kv_scales).
        self.kv_scale_values = (1.0, 1.0)
        if kv_scales:
            self.k_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
            self.v_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)

    def _head_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The per-head q and k norms' weights the rotary kernel applies (or None)."""
        if self.norm_whole or self.q_norm is None or self.k_norm is None:
            return None, None
        return self.q_norm.weight, self.k_norm.weight

    def _norm_whole(self, x: torch.Tensor, key: bool = False) -> torch.Tensor:
        norm = self.k_norm if key else self.q_norm
        assert norm is not None
        normed = norm(x.contiguous())
        assert isinstance(normed, torch.Tensor)
        return normed

    def prepare_kv_scales(self) -> None:
        """After loading: the checkpoint's scales as the floats the kernels take."""
        if hasattr(self, "k_scale"):
            values = (float(self.k_scale), float(self.v_scale))
            # the kernels multiply by the inverse in float32: it must be finite there too
            if not all(1.0 / 3.4e38 < v < float("inf") for v in values):
                raise ValueError(f"KV cache scales must be positive and finite, got {values}")
            self.kv_scale_values = values

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: Activation,  # [T, hidden], normed (quantized per token for an FP8 qkv_proj)
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        lora: LoraTokens | None = None,  # the tokens' LoRA slots, with LoRA
    ) -> torch.Tensor:  # [T, hidden]
        meta = meta.of_group(self.kv_group)
        qkv = self.qkv_proj(x, lora)  # [T, q + 2 kv]
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        head_norms = self._head_norms()
        if self.norm_whole:
            q, k = self._norm_whole(q), self._norm_whole(k, key=True)
        if self.clip_qkv is not None:  # after the norms over all heads, as OLMoE clips
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        fp8_cache = kv_cache.dtype == torch.float8_e4m3fn
        k_scale, v_scale = self.kv_scale_values if fp8_cache else (1.0, 1.0)
        q = ops.rotary_write_kv(
            positions,
            q,
            k,
            v,
            self.rotary.cos_sin_cache,
            kv_cache[0],
            kv_cache[1],
            meta.slot_mapping,
            *head_norms,
            self.eps,
            k_scale,
            v_scale,
        )  # [T, H, D], rotated; the rotated keys and the values are in the cache now
        out = ops.paged_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            meta.max_seq_len,
            self.scale * k_scale,  # the cached keys times k_scale
            meta.decode_queries,
            self.window,
            self.sinks,
            self.softcap,
        )  # [T, H, D]
        if v_scale != 1.0:
            out = out * v_scale  # the cached values times v_scale
        # This rank's part: the next RMSNorm sums the ranks' (its `reduce`).
        return self.o_proj(out.reshape(num_tokens, self.q_size), lora)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        layout: ShardLayout,
        rotary: RotaryEmbedding,
        method: LinearMethod | None,
        kv_scales: bool = False,
        sparse: bool = False,
        experts: ExpertsMethod | None = None,
        window: int | None = None,
    ) -> None:
        """`sparse`: the layer's MLP is the model's mixture of experts (else a gated MLP),
        whose experts are stored as `experts` says (None: float); `window`: its attention's
        sliding window (None: the whole context)."""
        super().__init__()
        cfg = layout.local_config
        self.post_norms = cfg.post_norms or cfg.sandwich_norms
        if self.post_norms:  # OLMo 2, and Gemma 3's after-sublayer norms
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.post_norms and cfg.sandwich_norms:  # Gemma 3's before-sublayer norm of the MLP
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.post_norms:  # all but OLMo 2
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        # Gemma's: the norm of the last layer's output, which this layer's first kernel applies
        # (`follow`; held in a tuple: it is the last layer's module, not this one's).
        self.entry_norm: tuple[RMSNorm, ...] = ()
        self.self_attn = Attention(layout, rotary, method, kv_scales, window=window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(layout, experts) if sparse else GatedMLP(layout, method)
        self.tp = layout.tp
        self.residual_multiplier = cfg.residual_multiplier  # Granite's

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoraTokens | None = None,
        aux_out: torch.Tensor | None = None,  # [T, hidden]: takes the residual stream in
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each norm is told the projection it feeds: an FP8 one takes its input quantized.
        # Attention and the MLP return their rank's part of a sum (their last projections are
        # row-parallel); the norm after each adds the ranks' parts up (`reduce`).
        if self.post_norms:
            return self._post_normed(positions, x, residual, kv_cache, meta, lora, aux_out)
        qkv_proj = self.self_attn.qkv_proj
        if residual is None:  # x: the embedding (with tensor parallelism, a rank's part)
            x, residual = self.input_layernorm.begin(x, feeds=qkv_proj, reduce=self.tp)
        else:
            x, residual = self.input_layernorm(x, residual, feeds=qkv_proj, reduce=self.tp)
        if aux_out is not None:  # now, before the next norm adds to it in place
            aux_out.copy_(residual)
        x = self._scaled(self.self_attn(positions, x, kv_cache, meta, lora))
        if isinstance(self.mlp, SparseMoE):  # float rows in; no LoRA (refused at start)
            x, residual = self.post_attention_layernorm(x, residual, reduce=self.tp)
            return self._scaled(self.mlp(x, meta.slot_mapping)), residual
        x, residual = self.post_attention_layernorm(
            x, residual, feeds=self.mlp.gate_up_proj, reduce=self.tp
        )
        return self._scaled(self.mlp(x, lora)), residual

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as it joins the residual stream (Granite scales it)."""
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier

    def _post_normed(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoraTokens | None,
        aux_out: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo 2's layer: each sublayer reads the residual stream itself (Gemma 3's: its norm),
        and its output is normed before it joins it. Returns (the MLP's normed output, the
        stream before it), which the next layer (or the final norm) adds, as for the other
        families."""
        # x: the embedding (a rank's part), or the last layer's MLP output: OLMo 2's normed
        # (whole), Gemma's not yet (a rank's part). Gemma's norms between sublayers run as one
        # kernel with the add into the stream (`RMSNorm.after`): its decode is launch-bound.
        if residual is None:
            stream = self.tp.all_reduce(x)
            attention_in = self.input_layernorm(stream) if self.sandwich else stream
        elif self.sandwich:
            last_output = self.entry_norm[0]
            attention_in, stream = self.input_layernorm.after(last_output, x, residual, self.tp)
        else:
            stream = attention_in = residual + x
        if aux_out is not None:
            aux_out.copy_(stream)
        attended = self.self_attn(positions, attention_in, kv_cache, meta, lora)
        if self.sandwich:
            after_attention = self.post_attention_layernorm
            mlp_in, stream = self.pre_feedforward_layernorm.after(
                after_attention, attended, stream, self.tp
            )
        else:
            stream = mlp_in = stream + self.post_attention_layernorm(attended, reduce=self.tp)
        if isinstance(self.mlp, SparseMoE):
            out = self.mlp(mlp_in, meta.slot_mapping)
        else:
            out = self.mlp(mlp_in, lora)
        if self.sandwich:  # normed by the next layer's first kernel, or with the final norm
            return out, stream
        return self.post_feedforward_layernorm(out, reduce=self.tp), stream

    def follow(self, before: DecoderLayer) -> None:
        """Take the layer before's output unnormed (Gemma's: see `entry_norm`)."""
        self.entry_norm = (before.post_feedforward_layernorm,)


class DecoderForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        max_position: int,
        method: LinearMethod | None = None,
        kv_scales: bool = False,
        tp: TensorParallel = ONE_RANK,
    ) -> None:
        """`method`: how the projections are stored and run (None: float weights); the
        lm_head keeps a float weight whatever it is. `kv_scales`: the checkpoint has an FP8
        KV cache's k_scale and v_scale in every attention layer. `tp`: this rank's place in
        a tensor-parallel group; ValueError if the model does not split its ways."""
        super().__init__()
        self.config = cfg
        self.layout = layout = ShardLayout.of(cfg, tp)
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        # LongRoPE: the step buffers offset a long request's positions into its long set
        self.long_rope = None if rotary.long_offset is None else LongRope(rotary.long_offset)
        local_rotary = rotary  # the sliding layers' (Gemma 3's own base, unscaled)
        if cfg.local_rope_theta is not None:
            local_rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.local_rope_theta, None)
        self.embed_tokens = VocabParallelEmbedding(layout, cfg.hidden_size)
        sparse = cfg.moe.sparse_layers if cfg.moe is not None else ()
        experts = experts_method(method) if sparse else None  # refuses what experts cannot run
        layers = (
            DecoderLayer(layout, local_rotary if i in cfg.sliding_layers else rotary, method,
                         kv_scales, i in sparse, experts,
                         cfg.sliding_window if i in cfg.sliding_layers else None)
            for i in range(cfg.num_layers)
        )  # fmt: skip
        self.layers = nn.ModuleList(layers)
        if cfg.sandwich_norms:
            for before, layer in zip(self.layers, self.layers[1:], strict=False):
                layer.follow(before)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        vocab = layout.vocab_parallel()
        self.lm_head = Linear(cfg.hidden_size, layout.vocab_rows, sharding=vocab)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Each expert's choices by real tokens since start, every layer's added up (the
        # experts' load, for /metrics); all of them on every rank, as every rank routes alike.
        self.expert_tokens: torch.Tensor | None = None
        if cfg.moe is not None:
            self.expert_tokens = torch.zeros(cfg.moe.num_experts, dtype=torch.int64)
            for layer in self.layers:
                if isinstance(layer.mlp, SparseMoE):
                    layer.mlp.counts_into(self.expert_tokens)
        # EAGLE-3 reads the residual stream that enters some layers (capture_aux_hidden).
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def expert_ranks(self) -> list[int]:
        """The rank that holds each expert whole (--enable-expert-parallel; across replicas,
        numbered as `TensorParallel.expert_rank`), else -1 for each (a part of it on every
        rank); [] without experts."""
        moe, tp = self.config.moe, self.layout.tp
        if moe is None:
            return []
        if not tp.expert_parallel:
            return [-1] * moe.num_experts
        ranks = tp.num_expert_ranks
        return [
            rank for rank in range(ranks) for _ in experts_of_rank(rank, ranks, moe.num_experts)
        ]

    def capture_aux_hidden(self, layer_ids: tuple[int, ...], max_tokens: int) -> torch.Tensor:
        """From now on each forward pass writes the residual stream entering each of these
        layers into the columns of one buffer, [tokens, len(layer_ids) * hidden], returned
        (fixed: a CUDA graph writes it too)."""
        hidden = self.config.hidden_size
        self.aux_layers = layer_ids
        self.aux_hidden = torch.zeros(  # a graph's padding rows are read too: no NaN there
            max_tokens,
            len(layer_ids) * hidden,
            dtype=self.embed_tokens.weight.dtype,
            device=self.embed_tokens.weight.device,
        )
        return self.aux_hidden

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, KV, D]
        meta: AttentionMetadata,
        lora: LoraTokens | None = None,  # the tokens' LoRA slots, with LoRA
    ) -> torch.Tensor:  # [T, hidden], final-normed
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if self.config.embedding_multiplier != 1.0:  # Granite's
            x = x * self.config.embedding_multiplier
        residual = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            aux = self._aux_columns(index, len(input_ids))
            x, residual = layer(positions, x, residual, kv_cache, meta, lora, aux)
        if self.config.sandwich_norms:  # the last layer's output norm, then the final one
            x, _ = self.norm.after(self.layers[-1].post_feedforward_layernorm, x, residual,
                                   self.layout.tp)  # fmt: skip
            return x
        # OLMo 2's layers end with their output whole: no ranks' parts to add up
        x, _ = self.norm(x, residual, reduce=ONE_RANK if self.config.post_norms else self.layout.tp)
        return x

    def _aux_columns(self, layer: int, num_tokens: int) -> torch.Tensor | None:
        """Where layer `layer` writes the residual stream entering it, if it does."""
        if layer not in self.aux_layers or self.aux_hidden is None:
            return None
        hidden = self.config.hidden_size
        column = self.aux_layers.index(layer) * hidden
        return self.aux_hidden[:num_tokens, column : column + hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Why not float32 here: greedy argmax is the same on the model dtype, and the sampler
        # copies to float32 where it computes probabilities. Soft-capped logits stay float32:
        # near the cap tanh flattens them, and bf16 would round the top ones into ties.
        logits = self.layout.tp.all_gather(self.lm_head(hidden))  # [N, vocab], model dtype
        if self.config.logits_scaling != 1.0:  # Granite's
            logits = logits / self.config.logits_scaling
        if (cap := self.config.final_logit_softcapping) is not None:  # Gemma 2's
            logits = torch.tanh(logits.float() / cap) * cap
        return logits

    def checkpoint_param(self, hf_name: str) -> tuple[str, int | None] | None:
        """Where a Hugging Face-named tensor loads: (our parameter, the piece of it the tensor
        fills in a fused layer, None: all of it), or None: it is not loaded (rotary tables are
        computed; a tied head is the embedding)."""
        if hf_name.startswith(_OTHER_MODALITIES):  # an image model's (Gemma 3's): not loaded
            return None
        # a model for text and images (Gemma 3's) names its text model's tensors under this
        hf_name = hf_name.removeprefix("language_model.").removeprefix("model.language_model.")
        name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        name = name.replace(".mlp.router.", ".mlp.gate.")  # gpt-oss's router
        expert = expert_piece(name)
        if expert is not None:
            return expert
        for old, new in _KV_SCALE_NAMES.items():
            name = name.replace(old, new) if name.endswith(old) else name
        if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        return checkpoint_name(name)


def _load_heads(
    param: nn.Parameter, tensor: CheckpointTensor, shard: int | None, name: str, first: int
) -> None:
    """A value a query head ([num_heads] in the checkpoint): the rank's heads from `first`."""
    copy_weight(param.data, read(unpacked(tensor, name).narrow(0, first, param.shape[0])), name)


def checkpoint_name(name: str) -> tuple[str, int | None]:
    """A Hugging Face module path's parameter here: (its name, the piece of a fused q/k/v or
    gate/up projection it fills, None: all of it)."""
    piece = next((p for p in _STACKED if f".{p}." in name), None)
    if piece is None:
        return name, None
    fused, shard = _STACKED[piece]
    return name.replace(piece, fused), shard
