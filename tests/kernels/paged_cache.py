"""A paged KV cache with each context in randomly chosen blocks, for the attention tests."""

from __future__ import annotations

import torch

BLOCK_SIZE = 16


def scattered_cache(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V for each context in randomly chosen blocks; every other slot holds NaN.

    Block 0 pads the block tables and the reference reads it for padding, so it is finite.
    """
    blocks_per_req = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + 8
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    key_cache[0] = 0.0
    value_cache[0] = 0.0
    free = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = []
    for seq_len, num_req_blocks in zip(seq_lens, blocks_per_req, strict=True):
        block_ids = [free.pop() for _ in range(num_req_blocks)]
        positions = torch.arange(seq_len)
        blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]  # [S]
        offsets = positions % block_size  # [S]
        kv_shape = (seq_len, num_kv_heads, head_dim)
        key_cache[blocks, offsets] = torch.randn(kv_shape, generator=generator).to(dtype)
        value_cache[blocks, offsets] = torch.randn(kv_shape, generator=generator).to(dtype)
        tables.append(block_ids)
    width = max(len(t) for t in tables) + 1  # one spare column of padding, as in the engine
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return key_cache, value_cache, block_tables
