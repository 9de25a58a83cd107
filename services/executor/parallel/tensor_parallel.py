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
them unchanged, each told its part (`Sharding`, from the layout). Its weights are cut from the
checkpoint's as they load (by each parameter's `weight_loader`, with the dimensions each linear
method declares: services/executor/parallel/shards.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kernels import ops
from kernels.all_gather import gather_takes
from kernels.all_reduce_norm import reduce_takes
from kernels.peers import PeerBuffers
from services.executor.parallel.replica_experts import ReplicaExperts


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group
    # A mixture of experts' experts whole, an Nth of them a rank (--enable-expert-parallel),
    # instead of every expert's Nth part of the columns
    expert_parallel: bool = False
    # With expert parallelism across data-parallel replicas, the experts spread over every
    # replica's ranks, and the mixture-of-experts layers exchange tokens between replicas
    replicas: ReplicaExperts | None = None
    # The one-shot collectives' buffers (parallel/symmetric_memory.py's with_peer_buffers): the
    # fused all-reduce's, the logits all-gather's
    reduce_peers: PeerBuffers | None = None
    gather_peers: PeerBuffers | None = None

    @property
    def expert_rank(self) -> int:
        """This rank's place among the ranks the experts spread over (expert parallelism):
        replica by replica, each replica's tensor-parallel ranks in order."""
        return self.rank + (self.replicas.replica * self.size if self.replicas else 0)

    @property
    def num_expert_ranks(self) -> int:
        """How many ranks the experts spread over (expert parallelism)."""
        return self.size * (self.replicas.replicas if self.replicas else 1)

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

    def smallest(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' values (what every rank can hold)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def smallest_each(self, values: list[int], device: torch.device) -> list[int]:
        """Each position's smallest value over the ranks (one all-reduce for the list)."""
        if self.size == 1 or not values:
            return values
        tensor = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return tensor.tolist()

    def first_rank_value(self, value: int, device: torch.device) -> int:
        """The first rank's value, on every rank."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.broadcast(tensor, group_src=0, group=self.group)
        return int(tensor.item())

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x [rows, cols] stacked along the first dimension, in rank order (a
        sharded weight made whole, once at load: NCCL's or gloo's all-gather)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts)

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
