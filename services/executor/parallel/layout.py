"""What one tensor-parallel rank holds of a model (`ShardLayout`), and the part of each checkpoint
tensor it loads (`rank_part`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.executor.parallel.shards import (
    Loaded,
    Piece,
    Sharding,
    Split,
    TensorDims,
    shard_tensor,
)
from services.executor.parallel.tensor_parallel import TensorParallel
from shared.model_config import ModelConfig


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
