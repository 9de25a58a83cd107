"""Writing new keys and values into the paged KV cache, in Triton.

Same as `kernels.cache.write_kv_reference`: token t's [KV, D] key and value go to slot
`slot_mapping[t]` (= block_id * block_size + offset) of the caches. A negative slot marks a
padding token (CUDA-graph batches pad with -1) whose K/V must not land anywhere: its program
masks every load and store off, with no host sync to find those tokens.

One program copies one token's block of KV heads for both key and value, addressing everything
through strides, so the key/value views into the fused qkv output and the cache halves
`kv_cache[0]` / `kv_cache[1]` of a [2, num_blocks, block_size, KV, D] tensor need no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TILE_ELEMENTS = 4096  # KV heads per program: about this many elements of K (and of V)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, KV, D]
    value_ptr,  # [T, KV, D]
    key_cache_ptr,  # [num_blocks, block_size, KV, D]
    value_cache_ptr,  # [num_blocks, block_size, KV, D]
    slot_mapping_ptr,  # [T] int32 or int64, negative = padding
    stride_slot,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    slot = tl.load(slot_mapping_ptr + tok * stride_slot).to(tl.int64)
    # NOTE: a padding token (slot < 0) counts zero heads, so every lane is masked off and
    # nothing is read or written. (A scalar `slot >= 0` and-ed into the mask would do the same,
    # but the Triton interpreter rejects the resulting mask dtype.)
    live_heads = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (heads < live_heads)[:, None] & (dims < head_dim)[None, :]
    block = slot // block_size
    offset = slot % block_size

    k_src = key_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :]
    v_src = value_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :]
    k_dst = (
        key_cache_ptr
        + block * stride_kc_block
        + offset * stride_kc_slot
        + heads[:, None] * stride_kc_head
        + dims[None, :]
    )
    v_dst = (
        value_cache_ptr
        + block * stride_vc_block
        + offset * stride_vc_slot
        + heads[:, None] * stride_vc_head
        + dims[None, :]
    )
    k = tl.load(k_src, mask=mask, other=0.0)
    v = tl.load(v_src, mask=mask, other=0.0)
    tl.store(k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [T, KV, D], head dims contiguous
    value: torch.Tensor,  # [T, KV, D], head dims contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], written in place
    slot_mapping: torch.Tensor,  # [T] int32 or int64: block_id * block_size + offset, or < 0
) -> None:
    """Scatter each token's K/V into its cache slot; tokens with a negative slot are skipped.

    Slots must be below num_blocks * block_size: they are not checked, which would need a sync.
    """
    _check_shapes(key, value, key_cache, value_cache, slot_mapping)
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _TILE_ELEMENTS // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        slot_mapping.stride(0),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        num_kv_heads,
        head_dim,
        key_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=min(max(block_h * block_d // 512, 1), 8),
    )


def _check_shapes(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or key.shape != value.shape or slot_mapping.shape != key.shape[:1]:
        raise ValueError(
            f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} must be [T, KV, D], [T, KV, D] and [T]"
        )
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, KV, D]")
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache {tuple(key_cache.shape)} does not hold key {tuple(key.shape)}")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the caches' head dims must be contiguous (they are written in place)")
