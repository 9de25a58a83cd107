"""Paged attention for mixed batches (prefill, chunked prefill, decode) in Triton, flash style.

The work is (request, query tile) items, for each KV head. A tile is BLOCK_Q consecutive query
tokens of one request times the GROUP query heads of one KV head, flattened into BLOCK_M rows
(token-major), so each key and value is read once per KV head per tile:

    rows of a tile (GROUP = 4)       context of request r, BLOCK_N tokens per step
    m = 0  token t0, head 0          [ full | full | full |diag |diag ]
    m = 1  token t0, head 1           0                    ^            ^
    m = 2  token t0, head 2                                |            last tile query
    m = 3  token t0, head 3                                first tile query
    m = 4  token t1, head 0
    ...                                full: every row sees every key, no masks
    m = M-1 token t(Q-1), head 3       diag: causal mask per row; past the last query: skipped

The tile walks the context with the online softmax (exp2 of log2e-scaled scores) and writes
its rows once. Programs find their items from query_start_loc on the device and loop over
them, so the launch depends on tensor shapes only: a CUDA graph captured on padded buffers
replays it for any mix of requests (zero-query requests have no items; tokens past
query_start_loc[-1] belong to no request and their rows are left unwritten). Same math as
`kernels.attention.paged_attention_reference`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from kernels.attention import PREFILL_REQS_MIN_POW2
from kernels.triton_decode_attention import _check_shapes, scores_log2_scale, soft_cap
from kernels.triton_stages import launch_fitting


@dataclasses.dataclass(frozen=True)
class PrefillTiles:
    """Launch shape; `paged_prefill_attention` picks one, tests and tuning may pass their own."""

    block_m: int  # rows per program (query tokens x query heads of one KV head), power of two
    block_n: int  # context tokens per inner step, a power of two >= 16
    num_warps: int
    num_stages: int  # software pipelining depth of the K/V loads (ignored by the interpreter)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):  # tl.dot needs both sides >= 16
                raise ValueError(f"{name} must be a power of two >= 16, got {size}")


@triton.jit
def _attend_context(
    acc,  # [M, D] float32, unnormalised weighted sum of values
    l_i,  # [M] float32, sum of exp2(score - max)
    m_i,  # [M] float32, running max of log2-scaled scores
    q,  # [M, D]
    query_pos,  # [M] context position of each row's query token
    key_cache_ptr,
    value_cache_ptr,
    table_row,  # this request's row of the block table
    head_offset,  # kv_head * stride_cache_head
    start,  # first context position, a multiple of BLOCK_N
    end,  # loop bound
    kv_end,  # one past the last position any row of the tile may see
    qk_scale,
    stride_cache_block,
    stride_cache_slot,
    window,  # with WINDOWED: a row sees the last `window` positions up to its own
    cap_scale,  # with SOFTCAPPED: softmax scale / cap (qk_scale is then cap * log2(e))
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False only where every row sees every position of the tile
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAPPED: tl.constexpr,
):
    dims = tl.arange(0, HEAD_DIM)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)  # [N] context positions
        pos_valid = pos < kv_end
        # Masked loads: slots past the context are never read, so garbage there cannot leak.
        if MASKED:
            block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_valid, other=0)  # [N]
        else:
            block_ids = tl.load(table_row + pos // BLOCK_SIZE)  # [N]
        slot_offsets = (
            block_ids.to(tl.int64) * stride_cache_block
            + (pos % BLOCK_SIZE) * stride_cache_slot
            + head_offset
        )  # [N]
        kv_offsets = slot_offsets[:, None] + dims[None, :]  # [N, D]
        if MASKED:
            k = tl.load(key_cache_ptr + kv_offsets, mask=pos_valid[:, None], other=0.0)
            v = tl.load(value_cache_ptr + kv_offsets, mask=pos_valid[:, None], other=0.0)
        else:
            k = tl.load(key_cache_ptr + kv_offsets)  # [N, D]
            v = tl.load(value_cache_ptr + kv_offsets)  # [N, D]
        k, v = (
            k.to(q.dtype),
            v.to(q.dtype),
        )  # an FP8 cache in the query's dtype (scales: the caller's)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, N], unscaled
        if SOFTCAPPED:  # cap * tanh(score * scale / cap), the cap taken by qk_scale
            scores = soft_cap(scores, cap_scale)
        if MASKED:
            visible = (pos[None, :] <= query_pos[:, None]) & pos_valid[None, :]
            if WINDOWED:
                visible &= pos[None, :] > query_pos[:, None] - window
            scores = tl.where(visible, scores, float("-inf"))
        # NOTE: the first tile a row meets holds position 0, which every row sees, so m_new
        # is finite from the first step on and exp2(m_i - m_new) never sees -inf - -inf.
        # In a window a row's first tiles may lie before it: their max stays -inf, and the
        # exponents are taken against 0 then.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1) * qk_scale)  # [M]
        m_base = m_new
        if WINDOWED:
            m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)  # [M], 0 on the first step
        # Scaling inside the exponent makes one fused multiply-add per score.
        p = tl.exp2(scores * qk_scale - m_base[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_reqs"])  # one compile for every batch size
def _prefill_kernel(
    out_ptr,  # [T, H, D]
    query_ptr,  # [T, H, D]
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, KV, D]
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, KV, D]
    block_tables_ptr,  # [R, max_blocks] int32
    seq_lens_ptr,  # [R] int32
    query_start_loc_ptr,  # [R + 1] int32
    qk_scale,  # softmax scale * log2(e)
    max_blocks,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_req,
    num_reqs,
    window,  # with WINDOWED: a query sees the last `window` positions up to its own
    sinks_ptr,  # [H] float32 with HAS_SINKS: each head's sink logit
    cap_scale,  # with SOFTCAPPED: softmax scale / cap (Gemma 2's logit soft-capping)
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two (padding rows masked)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per tile; BLOCK_M = BLOCK_Q * GROUP_PAD rows
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    REQS_POW2: tl.constexpr,  # num_reqs rounded up to a power of two
    SKIP_UP_TO: tl.constexpr,  # leave requests of this many tokens or fewer to the decode kernel
    WINDOWED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SOFTCAPPED: tl.constexpr,
):
    kv_head = tl.program_id(1)
    # Work items are (request, query tile) pairs, numbered request by request; the kernel
    # finds them from query_start_loc alone, so the grid depends on shapes only and the same
    # launch serves any mix of requests (what a CUDA graph of a padded step needs).
    reqs = tl.arange(0, REQS_POW2)
    in_batch = reqs < num_reqs
    req_starts = tl.load(query_start_loc_ptr + reqs, mask=in_batch, other=0)
    req_ends = tl.load(query_start_loc_ptr + reqs + 1, mask=in_batch, other=0)
    num_tiles = (req_ends - req_starts + BLOCK_Q - 1) // BLOCK_Q  # [R]
    num_tiles = tl.where(req_ends - req_starts <= SKIP_UP_TO, 0, num_tiles)
    items_through = tl.cumsum(num_tiles, 0)  # [R] items of requests 0..r
    num_items = tl.sum(num_tiles, 0)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        req = tl.sum((items_through <= item).to(tl.int32), 0)
        first_item = tl.sum(tl.where(reqs == req, items_through - num_tiles, 0), 0)
        # A request's last tiles see the most context: they come first, so long items do
        # not form the tail of the work.
        tiles_of_req = tl.sum(tl.where(reqs == req, num_tiles, 0), 0)
        q_tile = tiles_of_req - 1 - (item - first_item)
        _attend_tile(
            out_ptr,
            query_ptr,
            key_cache_ptr,
            value_cache_ptr,
            block_tables_ptr,
            seq_lens_ptr,
            query_start_loc_ptr,
            qk_scale,
            max_blocks,
            stride_q_token,
            stride_q_head,
            stride_out_token,
            stride_out_head,
            stride_cache_block,
            stride_cache_slot,
            stride_cache_head,
            stride_table_req,
            req,
            q_tile,
            kv_head,
            window,
            sinks_ptr,
            cap_scale,
            GROUP,
            GROUP_PAD,
            HEAD_DIM,
            BLOCK_SIZE,
            BLOCK_Q,
            BLOCK_N,
            DOT_PRECISION,
            WINDOWED,
            HAS_SINKS,
            SOFTCAPPED,
        )


@triton.jit
def _attend_tile(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale,
    max_blocks,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_req,
    req,
    q_tile,
    kv_head,
    window,
    sinks_ptr,
    cap_scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SOFTCAPPED: tl.constexpr,
):
    """One (request, query tile, KV head): attend over the context, write the tile's rows.
    In a window the tiles before the first row's window are not read, and the tiles every
    row sees whole need no mask: [first, full_start) masked, [full_start, full_end) not,
    [full_end, kv_end) masked."""
    q_start = tl.load(query_start_loc_ptr + req)
    num_queries = tl.load(query_start_loc_ptr + req + 1) - q_start
    first_tok = q_tile * BLOCK_Q

    # The request's first query sits at context position seq_len - num_queries.
    ctx_start = tl.load(seq_lens_ptr + req) - num_queries
    last_tok = tl.minimum(first_tok + BLOCK_Q, num_queries) - 1
    # NOTE: clamped to the table's capacity, so no slot outside the request's own blocks is
    # ever addressed, whatever seq_lens says.
    kv_end = tl.minimum(ctx_start + last_tok + 1, max_blocks * BLOCK_SIZE)
    # [0, full_end) is visible to every row of the tile: no masks needed there.
    full_end = tl.maximum(tl.minimum(ctx_start + first_tok + 1, kv_end), 0)
    full_end = full_end // BLOCK_N * BLOCK_N
    first, full_start = 0, 0
    if WINDOWED:  # the first row's window starts the reading; the last row's, the full tiles
        first = tl.maximum(ctx_start + first_tok - window + 1, 0) // BLOCK_N * BLOCK_N
        full_start = tl.cdiv(tl.maximum(ctx_start + last_tok - window + 1, 0), BLOCK_N) * BLOCK_N
        full_start = tl.minimum(tl.maximum(full_start, first), full_end)

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)  # [M]
    dims = tl.arange(0, HEAD_DIM)
    tok = first_tok + rows // GROUP_PAD  # [M] query index within the request
    heads = kv_head * GROUP + rows % GROUP_PAD  # [M] query head
    row_valid = (tok < num_queries) & (rows % GROUP_PAD < GROUP)
    token_index = (q_start + tok).to(tl.int64)  # [M] row of the flat batch
    q_ptrs = query_ptr + token_index[:, None] * stride_q_token + heads[:, None] * stride_q_head
    q = tl.load(q_ptrs + dims[None, :], mask=row_valid[:, None], other=0.0)  # [M, D]
    # Rows past the request's queries get later positions: they stay finite, and are not stored.
    query_pos = ctx_start + tok  # [M]

    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    table_row = block_tables_ptr + req * stride_table_req
    head_offset = kv_head * stride_cache_head
    # fmt: off
    if WINDOWED:
        acc, l_i, m_i = _attend_context(
            acc, l_i, m_i, q, query_pos, key_cache_ptr, value_cache_ptr, table_row, head_offset,
            first, full_start, kv_end, qk_scale, stride_cache_block, stride_cache_slot, window,
            cap_scale, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, WINDOWED, SOFTCAPPED,
        )
    acc, l_i, m_i = _attend_context(
        acc, l_i, m_i, q, query_pos, key_cache_ptr, value_cache_ptr, table_row, head_offset,
        full_start, full_end, kv_end, qk_scale, stride_cache_block, stride_cache_slot, window,
        cap_scale, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, WINDOWED, SOFTCAPPED,
    )
    acc, l_i, m_i = _attend_context(
        acc, l_i, m_i, q, query_pos, key_cache_ptr, value_cache_ptr, table_row, head_offset,
        full_end, kv_end, kv_end, qk_scale, stride_cache_block, stride_cache_slot, window,
        cap_scale, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, WINDOWED, SOFTCAPPED,
    )
    # fmt: on
    if HAS_SINKS:  # the sink's share of the softmax (log2 units, as m_i)
        sink = tl.load(sinks_ptr + heads, mask=row_valid, other=0.0).to(tl.float32)
        l_i += tl.exp2(sink * 1.4426950408889634 - m_i)
    out = acc / l_i[:, None]  # [M, D]
    out_ptrs = out_ptr + token_index[:, None] * stride_out_token + heads[:, None] * stride_out_head
    tl.store(out_ptrs + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def default_tiles(
    head_dim: int, group: int, max_query_len: int, element_size: int = 2
) -> PrefillTiles:
    """Large tiles for prompts; fewer rows when every query run in the batch is short.

    The picks are the best of sweeps on an H200 (prompts of 512-2048 tokens, 8 KV heads).
    """
    if element_size > 2:
        # float32 (tests, debugging) takes the non-tensor-core dot ("ieee"); bigger tiles
        # spill registers and ran ~9x slower.
        block_m, block_n, num_warps, num_stages = 32, 32, 4, 2
    elif head_dim <= 64:
        block_m, block_n, num_warps, num_stages = 64, 64, 4, 2
    elif head_dim <= 128:
        # NOTE: 3 stages take 161 KB of shared memory a block on Hopper, 97 KB before
        # (Triton 3.6-3.9): within the 99 KB of an L40S or A10 (kernels/triton_stages.py).
        block_m, block_n, num_warps, num_stages = 128, 128, 8, 3
    else:
        block_m, block_n, num_warps, num_stages = 64, 32, 4, 2
    rows_needed = triton.next_power_of_2(max_query_len) * triton.next_power_of_2(group)
    if rows_needed < block_m:
        block_m, num_warps = max(16, rows_needed), 4
    return PrefillTiles(block_m, block_n, num_warps, num_stages)


def reqs_pow2(num_reqs: int) -> int:
    """The kernel's REQS_POW2 for a batch (kernels.attention.PREFILL_REQS_MIN_POW2)."""
    return max(PREFILL_REQS_MIN_POW2, triton.next_power_of_2(num_reqs))


@functools.cache
def _programs_per_kv_head(device: torch.device, num_kv_heads: int) -> int:
    """Programs per KV head: eight per SM in all (a few waves, so the hardware balances
    uneven items); four on the CPU interpreter, so tests loop over several items each."""
    if device.type != "cuda":
        return 4
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, 8 * num_sms // num_kv_heads)


def _check_metadata(
    query: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    num_reqs = seq_lens.shape[0]
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {query.shape}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_reqs:
        raise ValueError(f"block_tables must be [{num_reqs}, max_blocks], got {block_tables.shape}")
    if query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(f"query_start_loc must be [{num_reqs + 1}], got {query_start_loc.shape}")


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    *,
    tiles: PrefillTiles | None = None,  # None picks from head_dim, GQA group and max_query_len
    skip_queries_up_to: int = 0,  # leave the rows of requests of this many tokens or fewer
    window: int | None = None,  # a sliding window: a query sees its last `window` positions
    sinks: torch.Tensor | None = None,  # [num_heads] float32: each head's sink logit
    softcap: float | None = None,  # scores become softcap * tanh(score / softcap) (Gemma 2)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query.dtype
    """Causal attention of each request's queries over its paged context, any mix of rows;
    with a window, the context tiles before a tile's windows are not read.

    Requests of up to skip_queries_up_to query tokens get no work here: the caller runs the
    split-KV decode kernel on their rows (`paged_decode_attention` with query_start_loc and
    max_queries).
    The grid comes from shapes only (num_tokens, num_reqs, num_kv_heads), so there is no
    device-to-host sync and a CUDA graph can replay the launch; max_query_len only picks the
    tiles; max_seq_len is unused (each program reads its own seq_len) and kept for the shared
    attention signature.
    """
    del max_seq_len
    _check_shapes(query, key_cache, value_cache)
    _check_metadata(query, block_tables, seq_lens, query_start_loc)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_reqs = seq_lens.shape[0]
    group = num_heads // key_cache.shape[2]
    tiles = tiles or default_tiles(head_dim, group, max_query_len, query.element_size())

    out = torch.empty_like(query, memory_format=torch.contiguous_format)  # [T, H, D]
    if num_reqs == 0 or max_query_len == 0 or query.shape[0] == 0:
        return out
    _launch_prefill(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, scale,
        tiles, skip_queries_up_to, window, sinks, softcap,
    )  # fmt: skip
    return out


def _launch_prefill(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    block_tables: torch.Tensor,  # [R, max_blocks] int
    seq_lens: torch.Tensor,  # [R] int
    query_start_loc: torch.Tensor,  # [R + 1] int
    out: torch.Tensor,  # [T, H, D], contiguous
    scale: float,
    tiles: PrefillTiles,
    skip_queries_up_to: int,
    window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> None:
    """One launch of the prefill kernel on int32 metadata, its grid fixed by shapes alone."""
    num_reqs, num_kv_heads = seq_lens.shape[0], key_cache.shape[2]
    block_tables = block_tables.to(torch.int32).contiguous()  # [R, max_blocks]
    seq_lens = seq_lens.to(torch.int32).contiguous()  # [R]
    query_start_loc = query_start_loc.to(torch.int32).contiguous()  # [R + 1]
    constants = _prefill_constants(query, key_cache, tiles, num_reqs, skip_queries_up_to)
    constants.update(
        WINDOWED=window is not None, HAS_SINKS=sinks is not None, SOFTCAPPED=softcap is not None
    )
    grid = _prefill_grid(query, num_reqs, num_kv_heads, constants["BLOCK_Q"])
    args = (
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scores_log2_scale(scale, softcap),
        block_tables.shape[1],
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        num_reqs,
        window or 0,
        sinks if sinks is not None else seq_lens,
        scale / softcap if softcap is not None else 0.0,
    )
    variant = ("prefill_attention", query.device, query.dtype, key_cache.dtype, *constants.values())
    launch_fitting(
        variant,
        tiles.num_stages,
        lambda stages: _prefill_kernel[grid](*args, **constants, num_stages=stages),
    )


def _prefill_grid(
    query: torch.Tensor, num_reqs: int, num_kv_heads: int, block_q: int
) -> tuple[int, int]:  # (programs per KV head, KV heads)
    """Every program loops over work items; enough programs to fill the GPU a few times over,
    fewer where the step has fewer items. Shapes alone fix the grid (see the kernel)."""
    max_items = num_reqs + triton.cdiv(query.shape[0], block_q)
    return (min(max_items, _programs_per_kv_head(query.device, num_kv_heads)), num_kv_heads)


def _prefill_constants(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    tiles: PrefillTiles,
    num_reqs: int,
    skip_queries_up_to: int,
) -> dict:
    """The prefill kernel's compile-time constants and launch options: a tile's BLOCK_M rows
    are BLOCK_Q tokens of GROUP_PAD query heads each."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    return dict(
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_Q=max(1, tiles.block_m // group_pad),
        BLOCK_N=tiles.block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        REQS_POW2=reqs_pow2(num_reqs),
        SKIP_UP_TO=skip_queries_up_to,
        num_warps=tiles.num_warps,
    )
