"""The token embedding, split by vocabulary rows across tensor-parallel ranks."""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from services.executor.layers.weight_loader import set_weight_loader, sharded_loader
from services.executor.parallel.layout import ShardLayout
from services.executor.parallel.shards import TensorDims


class VocabParallelEmbedding(nn.Module):
    """The rank's rows of the embedding: each id is looked up by the rank that holds it."""

    def __init__(self, layout: ShardLayout, hidden_size: int) -> None:
        super().__init__()
        self.layout = layout
        self.weight = nn.Parameter(torch.empty(layout.vocab_rows, hidden_size))
        loader = sharded_loader(layout.vocab_parallel(), TensorDims(rows=0, cols=1))
        set_weight_loader(self.weight, loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        """This rank's part of the embedding: the rows of the ids it holds, zeros for the
        others. Summed over the ranks (by the first norm: RMSNorm.begin), the embedding."""
        return ops.embedding_rows(input_ids, self.weight, self.layout.vocab_start)
