"""What one tensor-parallel rank holds of a model (`ShardLayout`), and how each kind of layer
holds its part of the checkpoint's tensors (`Sharding`: services/executor/parallel/shards.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.executor.parallel.shards import Piece, Sharding
from services.executor.parallel.tensor_parallel import TensorParallel
from shared.model_config import ModelConfig


@dataclass(frozen=True)
class ShardLayout:
    """What one rank holds of a model."""

    tp: TensorParallel
    # The rank's layers: its heads, KV heads, MLP columns and each expert's columns
    # (vocab_size stays the model's: every rank samples from all of it)
    local_config: ModelConfig
    kv_heads: int  # the model's KV heads
    kv_head: int  # the first of them this rank holds (with fewer than ranks: the one it shares)
    vocab_start: int  # the first vocabulary row of its embedding and lm_head
    vocab_rows: int  # how many it holds
    # A mixture of experts' experts the rank holds: all of them, or with expert parallelism an
    # Nth, whole (in order: ranks 0..N-1 take consecutive runs, the first ones the shorter)
    experts: range = range(0)

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
        if cfg.moe is not None:  # each expert splits like a dense MLP (or is whole, with EP)
            problems += [
                f"{count} {what} do not split {n} ways"
                for count, what in (
                    (0 if tp.expert_parallel else cfg.moe.intermediate_size,
                     "columns of each expert"),
                    (cfg.moe.shared_expert_size, "shared expert columns"),
                )
                if count % n
            ]  # fmt: skip
            if tp.expert_parallel and cfg.moe.num_experts < tp.num_expert_ranks:
                ranks = tp.num_expert_ranks
                problems.append(f"{cfg.moe.num_experts} experts are fewer than the {ranks} ranks")
        if cfg.qk_norm_whole and n > 1:
            problems.append("q and k norms over all heads at once (OLMoE's, OLMo 2's) do not split")
        kv = cfg.num_kv_heads
        if kv % n and n % kv:
            problems.append(f"{kv} KV heads neither split {n} ways nor divide {n}")
        if problems:
            raise ValueError(f"--tensor-parallel-size {n}: " + "; ".join(problems))
        local_kv = kv // n if kv >= n else 1
        moe, experts = None, range(0)
        if cfg.moe is not None:
            columns = 1 if tp.expert_parallel else n
            moe = dataclasses.replace(
                cfg.moe,
                intermediate_size=cfg.moe.intermediate_size // columns,
                shared_expert_size=cfg.moe.shared_expert_size // n,
            )
            total = cfg.moe.num_experts
            experts = range(total)
            if tp.expert_parallel:
                experts = experts_of_rank(tp.expert_rank, tp.num_expert_ranks, total)
        local = dataclasses.replace(
            cfg,
            num_heads=cfg.num_heads // n,
            num_kv_heads=local_kv,
            intermediate_size=cfg.intermediate_size // n,
            moe=moe,
        )
        kv_head = tp.rank * local_kv if kv >= n else tp.rank * kv // n
        vocab_rows = cfg.vocab_size // n
        return cls(tp, local, kv, kv_head, tp.rank * vocab_rows, vocab_rows, experts)

    def column_parallel(self, *rows: int) -> Sharding:
        """A layer split by output rows (gate_up_proj, the lm_head): `rows` of each fused
        piece on this rank, its equal part of the piece."""
        return Sharding("rows", tuple(Piece(n, self.tp.rank, self.tp.size) for n in rows))

    def qkv_parallel(self) -> Sharding:
        """q, k and v split by output rows: the rank's query heads, and its KV heads (the one
        it shares with other ranks, when there are fewer KV heads than ranks)."""
        cfg = self.local_config
        q = Piece(cfg.num_heads * cfg.head_dim, self.tp.rank, self.tp.size)
        local_kv = cfg.num_kv_heads  # the rank's KV heads: part kv_head / local_kv of them
        kv_part, kv_parts = self.kv_head // local_kv, self.kv_heads // local_kv
        kv = Piece(local_kv * cfg.head_dim, kv_part, kv_parts)
        return Sharding("rows", (q, kv, kv))

    def row_parallel(self, rows: int) -> Sharding:
        """A layer split by input columns (o_proj, down_proj): all `rows`, the rank's part of
        the columns (its inputs are its heads' or its MLP columns' outputs)."""
        return Sharding("cols", (Piece(rows, self.tp.rank, self.tp.size),))

    def vocab_parallel(self) -> Sharding:
        """The embedding's and the lm_head's vocabulary rows."""
        return self.column_parallel(self.vocab_rows)


def experts_of_rank(rank: int, ranks: int, num_experts: int) -> range:
    """The experts a rank holds whole under expert parallelism: ranks take consecutive runs,
    the first ones the shorter."""
    return range(rank * num_experts // ranks, (rank + 1) * num_experts // ranks)
