"""Per-head q/k RMSNorm (optional), rotary embedding and the KV-cache write, in one Triton kernel.

Same math as `kernels.rotary_cache.rotary_write_kv_reference`. Unfused, the decoder runs this
as two kernels per layer (rotary, KV write), four with Qwen3's q_norm / k_norm; at batch-1
decode each launch costs about as much GPU time as the work it does, so one launch replaces them.

For each token, with half = head_dim // 2 and cos/sin read from `cos_sin_cache[position]`:

    x            = rms_norm(x) * weight           (if the norm weight is given; per head)
    lo', hi'     = lo * cos_lo - hi * sin_lo,  hi * cos_hi + lo * sin_hi
    query        <- rotated query                 (in place)
    cache[slot]  <- rotated key, value            (nothing when slot < 0: a padding token)

computed in float32 and stored in the destination's dtype. The norm's output is rounded to the
input dtype before rotating, where the unfused decoder rounds it (stored between two kernels).

The key is rotated in registers and written only to the cache: its slice of the fused qkv
output is left as it was, since attention reads keys from the cache.

Grid: (token, head block). Each token's heads are split into `num_head_blocks` programs, each
taking an equal share of the query heads and of the KV heads (for GQA, one group of query
heads beside its KV heads), so the programs are balanced and a batch-1 decode still runs a few
of them in parallel. Each program reads its token's cos/sin row once for both q and k.

Everything is addressed through strides: q/k/v are views into the fused qkv output
([T, H + 2 KV, D] rows) and the caches are `kv_cache[0]` / `kv_cache[1]` of a
[2, num_blocks, block_size, KV, D] tensor. No host sync, no allocation: it is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_e4m3 import to_e4m3
from kernels.triton_pdl import launches_early, wait_for_previous_kernel

_TILE_ELEMENTS = 2048  # head blocks are split until a program moves about this many q+k+v elements
_MAX_WARPS = 8


@triton.jit
def _load_cos_sin(
    cos_sin_ptr,  # [max_position, 2, D]
    pos,  # int64 scalar
    stride_pos,
    stride_kind,  # cos -> sin
    dims,  # [BLOCK_HALF]
    dim_ok,  # [BLOCK_HALF]
    half,
):
    cos_ptrs = cos_sin_ptr + pos * stride_pos + dims
    sin_ptrs = cos_ptrs + stride_kind
    # Both halves are read, so any table works, not only one whose halves repeat.
    cos_lo = tl.load(cos_ptrs, mask=dim_ok, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptrs + half, mask=dim_ok, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptrs, mask=dim_ok, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptrs + half, mask=dim_ok, other=0.0).to(tl.float32)
    return cos_lo, cos_hi, sin_lo, sin_hi  # each [BLOCK_HALF] float32


@triton.jit
def _rms_norm_halves(
    lo,  # [B, BLOCK_HALF] in the input dtype, masked lanes 0
    hi,  # [B, BLOCK_HALF]
    weight_ptr,  # [D]
    dims,  # [BLOCK_HALF]
    dim_ok,  # [BLOCK_HALF]
    half,
    eps,
):
    """Each row (head) normalised over both halves, rounded as `kernels.norm` rounds."""
    dtype = lo.dtype
    lo32 = lo.to(tl.float32)
    hi32 = hi.to(tl.float32)
    mean_sq = (tl.sum(lo32 * lo32, axis=1) + tl.sum(hi32 * hi32, axis=1)) / (2 * half)  # [B]
    rstd = tl.rsqrt(mean_sq + eps)[:, None]  # [B, 1]; masked heads get a finite 1/sqrt(eps)
    w_lo = tl.load(weight_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    w_hi = tl.load(weight_ptr + half + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    # Rounded to the input dtype before and after the weight multiply, as the reference.
    lo = (lo32 * rstd).to(dtype).to(tl.float32) * w_lo
    hi = (hi32 * rstd).to(dtype).to(tl.float32) * w_hi
    return lo.to(dtype), hi.to(dtype)


@triton.jit
def _load_halves(ptr, offs, mask, half):
    lo = tl.load(ptr + offs, mask=mask, other=0.0)
    hi = tl.load(ptr + offs + half, mask=mask, other=0.0)
    return lo, hi  # each [B, BLOCK_HALF] in the tensor's dtype, masked lanes 0


@triton.jit
def _rotate(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi):
    lo = lo.to(tl.float32)
    hi = hi.to(tl.float32)
    new_lo = lo * cos_lo[None, :] - hi * sin_lo[None, :]
    new_hi = hi * cos_hi[None, :] + lo * sin_hi[None, :]
    return new_lo, new_hi  # each [B, BLOCK_HALF] float32


@triton.jit
def _store_halves(ptr, offs, lo, hi, half, mask):
    tl.store(ptr + offs, lo.to(ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + offs + half, hi.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_cache_halves(ptr, offs, lo, hi, half, mask, src_dtype: tl.constexpr, inv_scale):
    """Into the KV cache: an FP8 cache (e4m3, values / scale) takes them as the reference
    does, rounded to the key's dtype first, times the inverse scale, saturated and rounded."""
    if ptr.dtype.element_ty == tl.float8e4nv:
        lo = to_e4m3(lo.to(src_dtype).to(tl.float32) * inv_scale)
        hi = to_e4m3(hi.to(src_dtype).to(tl.float32) * inv_scale)
    _store_halves(ptr, offs, lo, hi, half, mask)


@triton.jit
def _rotary_write_kv_kernel(
    positions_ptr,  # [T] int32 or int64
    slot_mapping_ptr,  # [T] int32 or int64, negative = padding
    query_ptr,  # [T, H, D], rotated in place
    key_ptr,  # [T, KV, D], only read
    value_ptr,  # [T, KV, D], only read
    cos_sin_ptr,  # [max_position, 2, D]
    key_cache_ptr,  # [num_blocks, block_size, KV, D]
    value_cache_ptr,  # [num_blocks, block_size, KV, D], same strides as key_cache
    q_weight_ptr,  # [D], read only when HAS_Q_NORM
    k_weight_ptr,  # [D], read only when HAS_K_NORM
    stride_pos,
    stride_slot,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cs_pos,
    stride_cs_kind,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    num_heads,
    num_kv_heads,
    q_heads_per_program,
    kv_heads_per_program,
    half,
    block_size,
    eps,
    k_inv_scale,  # float32: 1 / the FP8 cache's key scale (1.0 for other caches)
    v_inv_scale,
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
):
    wait_for_previous_kernel(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    dims = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    dim_ok = dims < half
    pos = tl.load(positions_ptr + tok * stride_pos).to(tl.int64)
    cos_lo, cos_hi, sin_lo, sin_hi = _load_cos_sin(
        cos_sin_ptr, pos, stride_cs_pos, stride_cs_kind, dims, dim_ok, half
    )

    # Query: every token, padding included (as the reference), rotated where it lies.
    q_idx = tl.arange(0, BLOCK_Q)  # [BLOCK_Q]
    q_heads = head_block * q_heads_per_program + q_idx
    q_ok = (q_idx < q_heads_per_program) & (q_heads < num_heads)
    q_mask = q_ok[:, None] & dim_ok[None, :]  # [BLOCK_Q, BLOCK_HALF]
    q_row = query_ptr + tok * stride_q_tok
    q_offs = q_heads[:, None] * stride_q_head + dims[None, :]
    q_lo, q_hi = _load_halves(q_row, q_offs, q_mask, half)
    if HAS_Q_NORM:
        q_lo, q_hi = _rms_norm_halves(q_lo, q_hi, q_weight_ptr, dims, dim_ok, half, eps)
    q_lo, q_hi = _rotate(q_lo, q_hi, cos_lo, cos_hi, sin_lo, sin_hi)
    _store_halves(q_row, q_offs, q_lo, q_hi, half, q_mask)

    # Key and value: to the cache slot. NOTE: a padding token (slot < 0) counts zero KV heads,
    # so every K/V lane is masked off and nothing is read or written (a scalar `slot >= 0`
    # and-ed into the mask would do the same, but the Triton interpreter rejects that mask).
    slot = tl.load(slot_mapping_ptr + tok * stride_slot).to(tl.int64)
    live_kv_heads = tl.where(slot >= 0, num_kv_heads, 0)
    kv_idx = tl.arange(0, BLOCK_KV)  # [BLOCK_KV]
    kv_heads = head_block * kv_heads_per_program + kv_idx
    kv_ok = (kv_idx < kv_heads_per_program) & (kv_heads < live_kv_heads)
    kv_mask = kv_ok[:, None] & dim_ok[None, :]  # [BLOCK_KV, BLOCK_HALF]
    cache_offs = (
        (slot // block_size) * stride_cache_block
        + (slot % block_size) * stride_cache_slot
        + kv_heads[:, None] * stride_cache_head
        + dims[None, :]
    )  # [BLOCK_KV, BLOCK_HALF]
    k_row = key_ptr + tok * stride_k_tok
    k_offs = kv_heads[:, None] * stride_k_head + dims[None, :]
    k_lo, k_hi = _load_halves(k_row, k_offs, kv_mask, half)
    if HAS_K_NORM:
        k_lo, k_hi = _rms_norm_halves(k_lo, k_hi, k_weight_ptr, dims, dim_ok, half, eps)
    k_lo, k_hi = _rotate(k_lo, k_hi, cos_lo, cos_hi, sin_lo, sin_hi)
    _store_cache_halves(
        key_cache_ptr, cache_offs, k_lo, k_hi, half, kv_mask, key_ptr.dtype.element_ty, k_inv_scale
    )

    v_row = value_ptr + tok * stride_v_tok
    v_offs = kv_heads[:, None] * stride_v_head + dims[None, :]
    v_lo, v_hi = _load_halves(v_row, v_offs, kv_mask, half)
    _store_cache_halves(
        value_cache_ptr,
        cache_offs,
        v_lo,
        v_hi,
        half,
        kv_mask,
        value_ptr.dtype.element_ty,
        v_inv_scale,
    )


def rotary_write_kv(
    positions: torch.Tensor,  # [T] int32 or int64
    query: torch.Tensor,  # [T, H, D], head dims contiguous; rotated in place
    key: torch.Tensor,  # [T, KV, D], head dims contiguous; only read
    value: torch.Tensor,  # [T, KV, D], head dims contiguous; only read
    cos_sin_cache: torch.Tensor,  # [max_position, 2, D] float32: cos and sin
    key_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], written in place
    slot_mapping: torch.Tensor,  # [T] int32 or int64: block_id * block_size + offset, or < 0
    q_norm_weight: torch.Tensor | None = None,  # [D]
    k_norm_weight: torch.Tensor | None = None,  # [D]
    eps: float = 1e-6,
    k_scale: float = 1.0,  # an FP8 cache's scales (kernels/cache.py)
    v_scale: float = 1.0,
) -> torch.Tensor:  # the query itself, rotated
    """Rotate the query in place; write the rotated key and the value to their cache slots.

    Positions and slots are not range-checked, which would need a host sync: positions must be
    below max_position and slots below num_blocks * block_size.
    """
    _check_tokens(positions, query, key, value, slot_mapping)
    if key_cache.dtype != torch.float8_e4m3fn and (k_scale, v_scale) != (1.0, 1.0):
        raise ValueError(f"KV scales apply to an FP8 cache, not {key_cache.dtype}")
    _check_tables(query, key, cos_sin_cache, key_cache, value_cache, q_norm_weight, k_norm_weight)
    if query.shape[0] == 0:
        return query
    _launch_rotary_write_kv(
        positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping,
        q_norm_weight, k_norm_weight, eps, k_scale, v_scale,
    )  # fmt: skip
    return query


def _launch_rotary_write_kv(
    positions: torch.Tensor,  # [T]
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KV, D]
    value: torch.Tensor,  # [T, KV, D]
    cos_sin_cache: torch.Tensor,  # [max_position, 2, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    slot_mapping: torch.Tensor,  # [T]
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_scale: float,
    v_scale: float,
) -> None:
    """One launch of the kernel: a program per (token, head block)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    num_head_blocks, q_per_program, kv_per_program = _split_heads(
        num_heads, num_kv_heads, block_half
    )
    block_q = triton.next_power_of_2(q_per_program)
    block_kv = triton.next_power_of_2(kv_per_program)
    unused = cos_sin_cache  # stands in for an absent norm weight: never dereferenced
    early = launches_early(query)
    _rotary_write_kv_kernel[(num_tokens, num_head_blocks)](
        positions,
        slot_mapping,
        query,
        key,
        value,
        cos_sin_cache,
        key_cache,
        value_cache,
        unused if q_norm_weight is None else q_norm_weight,
        unused if k_norm_weight is None else k_norm_weight,
        *_strides(positions, slot_mapping, query, key, value, cos_sin_cache, key_cache),
        num_heads,
        num_kv_heads,
        q_per_program,
        kv_per_program,
        half,
        key_cache.shape[1],
        eps,
        1.0 / k_scale,
        1.0 / v_scale,
        HAS_Q_NORM=q_norm_weight is not None,
        HAS_K_NORM=k_norm_weight is not None,
        BLOCK_Q=block_q,
        BLOCK_KV=block_kv,
        BLOCK_HALF=block_half,
        PDL=early,
        num_warps=_num_warps(block_q, block_kv, block_half),
        launch_pdl=early,
    )


def _split_heads(
    num_heads: int, num_kv_heads: int, block_half: int
) -> tuple[int, int, int]:  # (num_head_blocks, q_per_program, kv_per_program)
    """A token's heads shared among its programs: an equal share of the query heads and of
    the KV heads each (`_num_head_blocks` programs)."""
    num_head_blocks = _num_head_blocks(num_heads, num_kv_heads, block_half)
    q_per_program = triton.cdiv(num_heads, num_head_blocks)
    kv_per_program = triton.cdiv(num_kv_heads, num_head_blocks)
    return num_head_blocks, q_per_program, kv_per_program


def _num_warps(block_q: int, block_kv: int, block_half: int) -> int:
    """Warps for a program's q, k and v elements (both halves of each head)."""
    elements = (block_q + 2 * block_kv) * 2 * block_half
    # About 16 elements per thread, as the other element-wise kernels.
    return min(max(triton.next_power_of_2(elements) // 512, 1), _MAX_WARPS)


def _strides(
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,  # value_cache shares its strides (_check_tables)
) -> tuple[int, ...]:
    """The kernel's stride arguments, in its order (head dims are contiguous: not passed)."""
    return (
        positions.stride(0),
        slot_mapping.stride(0),
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos_sin_cache.stride(0),
        cos_sin_cache.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
    )


def _num_head_blocks(num_heads: int, num_kv_heads: int, block_half: int) -> int:
    """Programs per token: doubled until each moves about _TILE_ELEMENTS of q, k and v.

    Llama-3.1-8B (32 q heads, 8 KV heads, head_dim 128): 4 programs of 8 q + 2 KV heads.
    """
    num_blocks = 1
    max_blocks = max(num_heads, num_kv_heads)
    while num_blocks < max_blocks:
        heads = triton.cdiv(num_heads, num_blocks) + 2 * triton.cdiv(num_kv_heads, num_blocks)
        if heads * 2 * block_half <= _TILE_ELEMENTS:
            break
        num_blocks *= 2
    return min(num_blocks, max_blocks)


def _check_tokens(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
            f"{tuple(value.shape)} must be [T, H, D], [T, KV, D] and [T, KV, D]"
        )
    num_tokens, _, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim or head_dim % 2:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} disagree on tokens or "
            "head_dim, or head_dim is odd"
        )
    for name, ids in (("positions", positions), ("slot_mapping", slot_mapping)):
        if ids.shape != (num_tokens,) or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{name} {tuple(ids.shape)} {ids.dtype} must be [{num_tokens}] int32 or int64"
            )
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        # NOTE: no copy fallback: the query is rotated in place, and copies would allocate
        # inside CUDA graphs. The decoder's q/k/v views always have contiguous head dims.
        raise ValueError("query, key and value must have contiguous head dims")


def _check_tables(
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
) -> None:
    head_dim = query.shape[2]
    if cos_sin_cache.dim() != 3 or cos_sin_cache.shape[1:] != (2, head_dim):
        raise ValueError(
            f"cos_sin_cache {tuple(cos_sin_cache.shape)} must be [max_position, 2, {head_dim}]"
        )
    if key_cache.dim() != 4 or key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} must be [num_blocks, block_size, "
            f"{key.shape[1]}, {head_dim}]"
        )
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        raise ValueError(
            "key_cache and value_cache must share one shape and layout (kv_cache[0], kv_cache[1])"
        )
    if key_cache.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("the caches' and cos_sin_cache's head dims must be contiguous")
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if weight is not None and (weight.shape != (head_dim,) or weight.stride(0) != 1):
            raise ValueError(
                f"{name} {tuple(weight.shape)} must be a contiguous [{head_dim}] vector"
            )
