"""An EAGLE-3 head: one decoder layer that guesses a target model's next tokens from the target's
own hidden states, in the published checkpoint format (EAGLE's `LlamaForCausalLMEagle3`).

The head reads, at position p, the token after p and a hidden state of p: for the first draft,
`fc` of the residual streams entering three of the target's layers (concatenated); for each
further draft, the head's own output stream at the position before. Its one layer normalises
the token's embedding and the hidden state apart, attends over both side by side (its qkv
projection reads twice the hidden size), and its lm_head covers a smaller draft vocabulary,
whose ids map to the target's through `d2t` (target id = draft id + d2t[draft id]).

Checkpoint names: fc.weight, midlayer.{input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}, norm.weight, lm_head.weight, d2t, t2d
(unused here), and embed_tokens.weight where the head has its own embedding (else it uses the
target's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import nn

from kernels import ops
from services.executor.layers.attention_metadata import AttentionMetadata
from services.executor.layers.embedding import VocabParallelEmbedding
from services.executor.layers.linear import Linear
from services.executor.layers.mlp import GatedMLP
from services.executor.layers.norm import RMSNorm
from services.executor.layers.rotary import RotaryEmbedding
from services.executor.models.decoder import Attention, checkpoint_name
from services.executor.parallel.layout import ShardLayout
from services.executor.parallel.tensor_parallel import ONE_RANK
from shared.model_config import ModelConfig, ModelSource, from_hf_dict

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the head's layer (vocab_size: the target's)
    draft_vocab_size: int  # its lm_head's rows
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # the target layers whose incoming stream `fc` reads


def read_eagle3_config(source: ModelSource, target: ModelConfig) -> Eagle3Config:
    """The head's config.json (a preset: the same as a file), checked against the target."""
    path = source.path if source.format == "preset" else source.path / "config.json"
    raw = json.loads(path.read_text())
    names = raw.get("architectures") or []
    if not set(names) & set(ARCHITECTURES):
        raise ValueError(
            f"{source.name} is not an EAGLE-3 head: its architectures are {names}, "
            f"not one of {', '.join(ARCHITECTURES)}"
        )
    layer = from_hf_dict({**raw, "model_type": raw.get("model_type", "llama")})
    if layer.num_layers != 1:
        raise ValueError(f"an EAGLE-3 head has one layer, {source.name} has {layer.num_layers}")
    if layer.vocab_size != target.vocab_size:
        raise ValueError(
            f"the EAGLE-3 head's vocabulary ({layer.vocab_size}) is not the target's "
            f"({target.vocab_size})"
        )
    target_hidden = raw.get("target_hidden_size") or layer.hidden_size
    if target_hidden != target.hidden_size:
        raise ValueError(
            f"the EAGLE-3 head reads hidden states of size {target_hidden}, the target's are "
            f"{target.hidden_size}"
        )
    n = target.num_layers
    default_ids = (2, n // 2, n - 3)  # EAGLE-3's choice: low, middle and high
    ids = tuple(
        (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids", default_ids)
    )
    if len(set(ids)) != len(ids) or not all(0 <= i < n for i in ids):
        raise ValueError(
            f"the EAGLE-3 head reads target layers {list(ids)}: they must be distinct layers of "
            f"the target's {n} (set eagle_config.eagle_aux_hidden_state_layer_ids)"
        )
    draft_vocab = raw.get("draft_vocab_size") or layer.vocab_size
    return Eagle3Config(layer, draft_vocab, target_hidden, ids)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__()
        layout = ShardLayout.of(cfg, ONE_RANK)
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(layout, rotary, None, input_size=2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(layout)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        embeds: torch.Tensor,  # [T, hidden]: of the token after each position
        hidden: torch.Tensor,  # [T, hidden]: of each position (fc'd target's, or the head's);
        # overwritten on the GPU with the residual stream (the fused norms work in place)
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (the MLP's output, the residual stream)
        eps = self.input_layernorm.eps  # the hidden norm's too: one config's
        x = ops.rms_norm_pair(
            embeds, self.input_layernorm.weight, hidden, self.hidden_norm.weight, eps
        )
        x = self.self_attn(positions, x, kv_cache, meta)
        # The fused norm writes the sum in place of `hidden`, which no caller reads again (the
        # fc's output, or the stream of the draft before): no copy of it.
        x, residual = self.post_attention_layernorm(x, hidden)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    def __init__(
        self, cfg: Eagle3Config, max_position: int, own_embedding: bool, target_embedding: nn.Module
    ) -> None:
        """`own_embedding`: the checkpoint has one; else the head reads `target_embedding`
        (held, not owned: not among the head's parameters)."""
        super().__init__()
        self.config = cfg
        hidden = cfg.layer.hidden_size
        self.fc = Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, hidden)
        self.midlayer = Eagle3Layer(cfg.layer, max_position)
        self.norm = RMSNorm(hidden, cfg.layer.rms_norm_eps)
        self.lm_head = Linear(hidden, cfg.draft_vocab_size)
        self.d2t = nn.Parameter(
            torch.zeros(cfg.draft_vocab_size, dtype=torch.int64), requires_grad=False
        )
        self.embed_tokens: nn.Module | None = None
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(ShardLayout.of(cfg.layer, ONE_RANK), hidden)
        self._target_embedding = [target_embedding]  # a list: not registered as a submodule

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[T, 3 * target hidden] -> [T, hidden]: the first draft's hidden states."""
        return self.fc(aux_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]: the token after each position
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, hidden]: overwritten (on the GPU, with the stream)
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (final-normed [T, hidden], the stream [T, hidden])
        embedding = (
            self.embed_tokens if self.embed_tokens is not None else self._target_embedding[0]
        )
        x, residual = self.midlayer(positions, embedding(input_ids), hidden, kv_cache, meta)
        return self.norm(x, residual)

    def draft_ids(self, normed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N] int64 (into `out` where given): each row's greedy guess, as a
        target token id (the argmax's kernel adds d2t)."""
        return ops.argmax(self.lm_head(normed), self.d2t, out)

    def checkpoint_param(self, hf_name: str) -> tuple[str, int | None] | None:
        """Where a checkpoint tensor loads (see DecoderForCausalLM.checkpoint_param); t2d,
        the target-to-draft table, is not read."""
        if hf_name == "t2d":
            return None
        name = hf_name.removeprefix("model.").replace("layers.0.", "midlayer.")
        return checkpoint_name(name)


def uses_own_embedding(names: list[str]) -> bool:
    return any(name.removeprefix("model.") == "embed_tokens.weight" for name in names)
