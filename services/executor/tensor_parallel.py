"""Tensor parallelism (Megatron-style) over a torch.distributed group: NCCL on CUDA, gloo on CPU.

Each of N ranks holds a 1/N part of every layer and all of it sees every token:

    embed_tokens   vocab rows [r V/N, (r+1) V/N): ids elsewhere give zeros; the first norm
                   adds the ranks' rows up (its all-reduce, fused)
    qkv_proj       column-parallel: its q heads and its KV heads (a KV head each rank shares
                   with others when there are fewer KV heads than ranks)
    attention      over its own heads, with its own KV cache
    o_proj         row-parallel: its heads' columns, then all-reduce
    gate_up_proj   column-parallel: its part of gate and of up
    down_proj      row-parallel, then all-reduce
    lm_head        vocab rows as the embedding, then all-gather: every rank has all logits and
                   samples the same tokens (same logits, same seeds)

A rank's layers are those of a smaller model (`ShardLayout.local_config`): the model code builds
them unchanged. Its weights are cut from the checkpoint's as they load (`rank_part`, by the
dimensions each linear method declares: services/executor/linear_shards.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernels import ops
from kernels.all_gather import gather_takes
from kernels.all_reduce_norm import reduce_takes
from kernels.peers import PeerBuffers
from services.executor.linear_shards import Loaded, Split, TensorDims, shard_tensor
from services.executor.symmetric_memory import gather_buffers, reduce_buffers
from shared.model_config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group
    # The one-shot collectives' buffers (with_peer_buffers): the fused all-reduce's, the
    # logits all-gather's
    reduce_peers: PeerBuffers | None = None
    gather_peers: PeerBuffers | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of x, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(sum + residual), sum + residual) with sum the ranks' x added up, in
        place of x and residual (no residual: the sum in a new tensor): one fused kernel over
        the peers' buffers where they take x, else NCCL's all-reduce and then the add and
        norm."""
        if self.reduce_peers is not None and reduce_takes(self.reduce_peers, x):
            return ops.all_reduce_add_rms_norm(x, residual, weight, eps, self.reduce_peers)
        x = self.all_reduce(x)
        if residual is None:
            return ops.rms_norm(x, weight, eps), x
        return ops.fused_add_rms_norm(x, residual, weight, eps)

    def with_peer_buffers(
        self, hidden: int, vocab_part: int, dtype: torch.dtype, device: torch.device
    ) -> TensorParallel:
        """This rank with the one-shot collectives' buffers, where the group can have them:
        for rows of `hidden` values and logits parts of `vocab_part`. Collective: every rank
        calls it at the same point."""
        if self.size == 1:
            return self
        reduce_peers = reduce_buffers(self, hidden, dtype, device)
        # Both or neither: the gather's setup follows the all-reduce's (the same conditions,
        # and a group that failed one would only log the same warning twice).
        gather_peers = None
        if reduce_peers is not None:
            gather_peers = gather_buffers(self, vocab_part, dtype, device)
        return dataclasses.replace(self, reduce_peers=reduce_peers, gather_peers=gather_peers)

    def smallest(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' values (what every rank can hold)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x [rows, cols] side by side along the last dimension, in rank order: one
        kernel over the peers' buffers where they take x, else NCCL's all-gather."""
        if self.size == 1:
            return x
        if self.gather_peers is not None and gather_takes(self.gather_peers, x):
            return ops.all_gather(x, self.gather_peers)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


ONE_RANK = TensorParallel()


@dataclass(frozen=True)
class ShardLayout:
    """What one rank holds of a model."""

    tp: TensorParallel
    # The rank's layers: its heads, KV heads and MLP columns (vocab_size stays the model's:
    # every rank samples from all of it)
    local_config: ModelConfig
    kv_heads: int  # the model's KV heads
    kv_head: int  # the first of them this rank holds (the one it shares, if shares_kv_heads)
    vocab_start: int  # the first vocabulary row of its embedding and lm_head
    vocab_rows: int  # how many it holds

    @classmethod
    def of(cls, cfg: ModelConfig, tp: TensorParallel) -> ShardLayout:
        """The rank's part; ValueError saying what does not split N ways."""
        n = tp.size
        problems = [
            f"{count} {what} do not split {n} ways"
            for count, what in (
                (cfg.num_heads, "query heads"),
                (cfg.intermediate_size, "MLP columns"),
                (cfg.vocab_size, "vocabulary rows"),
            )
            if count % n
        ]
        kv = cfg.num_kv_heads
        if kv % n and n % kv:
            problems.append(f"{kv} KV heads neither split {n} ways nor divide {n}")
        if problems:
            raise ValueError(f"--tensor-parallel-size {n}: " + "; ".join(problems))
        local_kv = kv // n if kv >= n else 1
        local = dataclasses.replace(
            cfg,
            num_heads=cfg.num_heads // n,
            num_kv_heads=local_kv,
            intermediate_size=cfg.intermediate_size // n,
        )
        kv_head = tp.rank * local_kv if kv >= n else tp.rank * kv // n
        vocab_rows = cfg.vocab_size // n
        return cls(tp, local, kv, kv_head, tp.rank * vocab_rows, vocab_rows)

    @property
    def shares_kv_heads(self) -> bool:
        """Fewer KV heads than ranks: each is held whole by several ranks."""
        return self.kv_heads < self.tp.size


class VocabParallelEmbedding(nn.Module):
    """The rank's rows of the embedding: each id is looked up by the rank that holds it."""

    def __init__(self, layout: ShardLayout, hidden_size: int) -> None:
        super().__init__()
        self.layout = layout
        self.weight = nn.Parameter(torch.empty(layout.vocab_rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        """This rank's part of the embedding: the rows of the ids it holds, zeros for the
        others. Summed over the ranks (by the first norm: RMSNorm.begin), the embedding."""
        return ops.embedding_rows(input_ids, self.weight, self.layout.vocab_start)


# The checkpoint's modules by how their tensors split: Q rows by heads, K and V rows by KV
# heads, gate and up rows by columns, o and down by input columns, embeddings by vocabulary.
_BY_ROWS = ("q_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_BY_KV_HEADS = ("k_proj", "v_proj")
_BY_COLUMNS = ("o_proj", "down_proj")


def rank_part(layout: ShardLayout, hf_name: str, tensor: Loaded, dims: TensorDims | None) -> Loaded:
    """The part of a checkpoint tensor this rank loads into a linear layer or the embedding
    (a view where it can be); `dims`: where the tensor holds rows and columns (the loading
    layer's method says; None: the embedding's weight). Other tensors (norms, KV cache
    scales) every rank holds whole: they are not handed here."""
    tp = layout.tp
    if tp.size == 1:
        return tensor
    modules = (*_BY_ROWS, *_BY_KV_HEADS, *_BY_COLUMNS)
    module = next((m for m in modules if _names(hf_name, m)), None)
    if module is None:
        raise ValueError(f"{hf_name}: no tensor-parallel cut is known for it")
    split: Split = "cols" if module in _BY_COLUMNS else "rows"
    if dims is None:
        dims = TensorDims(rows=0, cols=1)
    if module in _BY_KV_HEADS and layout.shares_kv_heads:
        return _kv_head_rows(layout, tensor, dims)
    return shard_tensor(tensor, dims, split, tp.rank, tp.size)


def _names(hf_name: str, module: str) -> bool:
    """Whether a checkpoint name is of that module ("model.layers.3.mlp.up_proj.weight")."""
    return hf_name.startswith(f"{module}.") or f".{module}." in hf_name


def _kv_head_rows(layout: ShardLayout, tensor: Loaded, dims: TensorDims) -> Loaded:
    """The rows of the one KV head this rank holds, of a K or V tensor."""
    if dims.rows is None:
        return tensor
    rows = tensor.shape[dims.rows] // layout.kv_heads
    return tensor.narrow(dims.rows, layout.kv_head * rows, rows)
