"""The decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3.

The families differ only in switches read from ModelConfig: a bias on the qkv projection
(Qwen2), an RMSNorm on each head of q and k (Qwen3), Llama 3's RoPE scaling, and tied
embeddings. Weights load from Hugging Face names (see `load_weights`). Under tensor
parallelism a rank builds the layers of its part (services/executor/parallel/tensor_parallel.py) and
loads its part of each weight.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from kernels import ops
from services.executor.layers.attention_metadata import AttentionMetadata
from services.executor.layers.embedding import VocabParallelEmbedding
from services.executor.layers.linear import Activation, Linear, LinearMethod
from services.executor.layers.lora import LoraTokens
from services.executor.layers.mlp import GatedMLP
from services.executor.layers.norm import RMSNorm
from services.executor.layers.rotary import RotaryEmbedding
from services.executor.parallel.layout import ShardLayout, rank_part
from services.executor.parallel.shards import Loaded, PackedWeight, packed_dims, read
from services.executor.parallel.tensor_parallel import ONE_RANK, TensorParallel
from shared.model_config import ModelConfig

# Older llm-compressor / AutoFP8 names of an FP8 KV cache's scales -> today's
_KV_SCALE_NAMES = {".k_proj.output_scale": ".k_scale", ".v_proj.output_scale": ".v_scale"}
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
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        method: LinearMethod | None,
        kv_scales: bool = False,
        tp: TensorParallel = ONE_RANK,
    ) -> None:
        """`cfg`: this rank's part of the model (all of it on one rank)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, method
        )
        whole_q = self.q_size * tp.size  # o_proj is row-parallel: its inputs are all ranks'
        self.o_proj = Linear(self.q_size, cfg.hidden_size, method=method, whole_in_features=whole_q)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.eps = cfg.rms_norm_eps  # of q_norm / k_norm
        self.scale = cfg.head_dim**-0.5
        # An FP8 cache holds key / k_scale and value / v_scale: 1.0 unless the checkpoint
        # calibrated them (`kv_scales`: loaded as k_scale and v_scale, read by prepare_kv_scales).
        self.kv_scale_values = (1.0, 1.0)
        if kv_scales:
            self.k_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
            self.v_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)

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
        qkv = self.qkv_proj(x, lora)  # [T, q + 2 kv]
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
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
            self.q_norm.weight if self.q_norm is not None else None,
            self.k_norm.weight if self.k_norm is not None else None,
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
        )  # [T, H, D]
        if v_scale != 1.0:
            out = out * v_scale  # the cached values times v_scale
        # This rank's part: the next RMSNorm sums the ranks' (its `reduce`).
        return self.o_proj(out.reshape(num_tokens, self.q_size), lora)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        method: LinearMethod | None,
        kv_scales: bool = False,
        tp: TensorParallel = ONE_RANK,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, method, kv_scales, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, method, tp)
        self.tp = tp

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoraTokens | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each norm is told the projection it feeds: an FP8 one takes its input quantized.
        # Attention and the MLP return their rank's part of a sum (their last projections are
        # row-parallel); the norm after each adds the ranks' parts up (`reduce`).
        qkv_proj = self.self_attn.qkv_proj
        if residual is None:  # x: the embedding (with tensor parallelism, a rank's part)
            x, residual = self.input_layernorm.begin(x, feeds=qkv_proj, reduce=self.tp)
        else:
            x, residual = self.input_layernorm(x, residual, feeds=qkv_proj, reduce=self.tp)
        x = self.self_attn(positions, x, kv_cache, meta, lora)
        x, residual = self.post_attention_layernorm(
            x, residual, feeds=self.mlp.gate_up_proj, reduce=self.tp
        )
        return self.mlp(x, lora), residual


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
        self.layout = ShardLayout.of(cfg, tp)
        local = self.layout.local_config
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(self.layout, cfg.hidden_size)
        layers = (DecoderLayer(local, rotary, method, kv_scales, tp) for _ in range(cfg.num_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, self.layout.vocab_rows)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, KV, D]
        meta: AttentionMetadata,
        lora: LoraTokens | None = None,  # the tokens' LoRA slots, with LoRA
    ) -> torch.Tensor:  # [T, hidden], final-normed
        x = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta, lora)
        x, _ = self.norm(x, residual, reduce=self.layout.tp)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Why not float32 here: greedy argmax is the same on the model dtype, and the sampler
        # copies to float32 where it computes probabilities.
        return self.layout.tp.all_gather(self.lm_head(hidden))  # [N, vocab], model dtype

    def load_weights(self, weights: Iterable[tuple[str, Loaded | PackedWeight]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; all must be present.
        A CheckpointSlice is read for the rank's part alone."""
        params = dict(self.named_parameters())  # a tied lm_head is not listed twice
        num_loaded: Counter[str] = Counter()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            for old, new in _KV_SCALE_NAMES.items():
                name = name.replace(old, new) if name.endswith(old) else name
            if "rotary_emb" in name or (name not in params and name == "lm_head.weight"):
                continue  # rotary tables are computed; a tied head is the embedding
            piece = next((p for p in _STACKED if f".{p}." in name), None)
            if isinstance(tensor, PackedWeight):
                self._load_packed(name, piece, tensor, hf_name)
                continue
            if piece is None:
                if name not in params:
                    raise ValueError(f"unexpected weight {hf_name!r}")
                _copy(params[name].data, read(self._rank_part(hf_name, name, tensor)), hf_name)
            else:
                fused, shard = _STACKED[piece]
                name = name.replace(piece, fused)
                if name not in params:
                    raise ValueError(f"unexpected weight {hf_name!r}")
                tensor = read(self._rank_part(hf_name, name, tensor))
                if name.endswith(".g_idx"):  # per input column: shared by the fused shards
                    _copy_shared(params[name].data, tensor, hf_name, first=not num_loaded[name])
                else:
                    _copy(self._shard(params[name], fused, shard), tensor, hf_name)
            num_loaded[name] += 1
        missing = [n for n in params if num_loaded[n] != _num_shards(n)]
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:5]}")

    def _shard(self, param: torch.Tensor, fused: str, shard: int) -> torch.Tensor:
        start, rows = self._shard_rows(fused, shard)
        return param.data.narrow(0, start, rows)

    def _rank_part(self, hf_name: str, name: str, tensor: Loaded) -> Loaded:
        """This rank's part of a checkpoint tensor, cut as the layer it loads into holds it;
        tensors of other modules (norms, KV cache scales) whole."""
        owner_name, _, leaf = name.rpartition(".")
        owner = self.get_submodule(owner_name)
        if isinstance(owner, Linear):
            return rank_part(self.layout, hf_name, tensor, owner.method.shard_dims(owner).get(leaf))
        if isinstance(owner, VocabParallelEmbedding):
            return rank_part(self.layout, hf_name, tensor, None)
        return tensor

    def _shard_rows(self, fused: str, shard: int) -> tuple[int, int]:
        """The rows [start, start + rows) of shard `shard` in a fused projection."""
        cfg = self.layout.local_config
        if fused == "qkv_proj":
            sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        else:
            sizes = [cfg.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]

    def _load_packed(
        self, name: str, piece: str | None, weight: PackedWeight, hf_name: str
    ) -> None:
        """A weight its layer's method loads itself, at the rows its shard takes."""
        start, rows = 0, None
        if piece is not None:
            fused, shard = _STACKED[piece]
            name = name.replace(piece, fused)
            start, rows = self._shard_rows(fused, shard)
        try:
            layer = self.get_submodule(name.removesuffix(".weight"))
        except AttributeError:
            layer = None
        method = layer.method if isinstance(layer, Linear) else None
        load_shard = getattr(method, "load_shard", None)
        if not name.endswith(".weight") or load_shard is None:
            raise ValueError(f"unexpected weight {hf_name!r} ({weight.qtype})")
        rows = layer.out_features if rows is None else rows
        dims = packed_dims(weight.qtype)
        weight = dataclasses.replace(
            weight, data=read(rank_part(self.layout, hf_name, weight.data, dims))
        )
        if weight.data.shape[0] != rows:
            raise ValueError(f"{hf_name}: checkpoint has {weight.data.shape[0]} rows, not {rows}")
        load_shard(layer, start, weight)


def _num_shards(name: str) -> int:
    return 3 if ".qkv_proj." in name else (2 if ".gate_up_proj." in name else 1)


def _copy_shared(target: torch.Tensor, tensor: torch.Tensor, name: str, first: bool) -> None:
    """A tensor every shard of a fused projection carries: loaded once, then checked."""
    if first:
        _copy(target, tensor, name)
    elif not torch.equal(target, tensor.to(target.device, target.dtype)):
        raise ValueError(f"{name} differs from the other projections fused with it")


def _copy(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if target.numel() == tensor.numel() == 1:  # a scalar, stored as [] or [1]
        tensor = tensor.reshape(target.shape)
    if target.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
    target.copy_(tensor)
