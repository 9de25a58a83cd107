"""Paged attention for decodes (one query token a request, or a few: a verifying row's), in
Triton, flash-decoding style.

Each request's context is cut into at most `num_splits` partitions; one program
handles one (request, KV head, partition) and attends all `group = num_heads // num_kv_heads`
query heads of that KV head at once, so every key and value is read once per KV head:

    context   [ split 0 ......... | split 1 ......... | split 2 ....... )     seq_lens[r]
    program   (r, kv, 0)            (r, kv, 1)          (r, kv, 2)
              -> max, sum, acc      -> max, sum, acc    -> max, sum, acc  (float32 scratch)

The last program of a (request, KV head) to finish, told by a ticket counter as in
kernels/triton_split_k.py, merges the partitions of its query heads with the usual log-sum-exp
rescaling and writes the output. The launch has `num_splits` programs for each (request, KV
head), chosen on the host from the batch and the block table's width (no device-to-host sync);
a split covers 1/num_splits of the width, but while the batch leaves SMs free each request's
own context decides how many take part (`_split_tokens`, `_split_rule`): about
sqrt(SPLIT_BALANCE * context) tokens a split, which weighs a split's loop against the merge's
walk over the partials. The others end at once, without a trace, and where the context fits
the first split, its program writes the output directly. A separate merge kernel cost a launch
per layer (a kernel boundary is about 3 us at batch 1). Same math as
`kernels.attention.paged_attention_reference` with one query per request.

In a mixed batch (`query_start_loc` given) the kernel attends only the requests with at most
`max_queries` query tokens (QUERIES), at their rows of the step's tokens, and leaves every other
row to the prefill kernel: a decode riding along with a prompt gets split-KV parallelism instead
of one program walking its whole context. Several query tokens of a request, a verifying row of
speculative decoding (its last token and its drafts), share the program's rows with the query
heads, each query masked causally at its own position:

    row i of the program's dots   query token i // GROUP, query head kv * GROUP + i % GROUP

so the context is read once for all of them, and with GQA groups of 4 the 4 tokens of three
drafts fill the 16 rows a dot needs anyway (one token pads 4 to 16).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch
import triton
import triton.language as tl

from kernels import triton_split_k as split_k
from kernels.invariance import INVARIANT_MAX_ROWS, batch_invariant
from kernels.triton_pdl import launches_early, wait_for_previous_kernel
from kernels.triton_stages import launch_fitting

LOG2E = 1.4426950408889634


def scores_log2_scale(scale: float, softcap: float | None) -> float:
    """What the attention kernels multiply a score by for exp2: the softmax scale in log2
    units, or with soft-capping the cap (soft_cap has applied the scale)."""
    return (softcap if softcap is not None else scale) * LOG2E


@triton.jit
def soft_cap(scores, cap_scale):
    """tanh(scores * cap_scale), cap_scale being the softmax scale over the cap: Gemma 2's
    logit soft-capping without the cap, which scores_log2_scale's factor brings."""
    return 2.0 * tl.sigmoid(2.0 * scores * cap_scale) - 1.0


# Splits down to one 64-token tile each: at batch 1 (8 KV heads, context bound 4096) 64 splits
# took 6.9 us per layer against 10.0 us with 16 (H100, CUDA graph, 256 tokens of context);
# larger batches get few splits anyway (4 * SMs programs are enough), where merging costs more.
MIN_PARTITION_TOKENS = 64
MAX_SPLITS = 64
# A request of C context tokens takes about sqrt(SPLIT_BALANCE * C) tokens a split (whole tiles),
# so C / split splits: H200, batch 1, Llama-3.1-8B heads, the best of 1-64 splits had 4, 8, 16,
# 32 and 32 splits at 256, 1,024, 4,096, 16,384 and 32,768 tokens (bf16 cache; 4,096 tokens
# took 13.2 us in 16 splits, 27.1 in 64: the last program's merge walks every split's partials).
SPLIT_BALANCE = 16
# --batch-invariant (kernels/invariance.py): splits of this many tokens, doubled only past
# MAX_SPLITS of them (16,384 tokens), so that a query's splits follow its own position alone.
INVARIANT_SPLIT_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    """One launch configuration of the partition kernel."""

    tile: int = 64  # context tokens per loop step; a power of two >= 16
    num_warps: int = 4  # warps per program
    num_stages: int = 3  # software-pipelined loop steps in flight (K/V tiles in smem)

    def __post_init__(self) -> None:
        # tl.dot needs at least 16 along the tile (the p @ v reduction), and tl.arange a power
        # of two. Each position looks up its own block, so a tile may span or share blocks.
        for name, value, low in (("tile", self.tile, 16), ("num_warps", self.num_warps, 1)):
            if value < low or value & (value - 1):
                raise ValueError(f"DecodeTiles.{name} must be a power of two >= {low}, got {value}")
        if self.num_stages < 1:
            raise ValueError(f"DecodeTiles.num_stages must be >= 1, got {self.num_stages}")


def default_decode_tiles(kv_dtype: torch.dtype, block_size: int) -> DecodeTiles:
    """sweeps/attention_sweep.py's picks (H100, Llama-3.1-8B heads, block_size 16), 4 warps
    and 3 stages: 64 tokens per step (or one block, if larger) read a bf16 cache at 0.99 of
    copy bandwidth, no other config faster (2026-11-26); an e4m3 cache, read as words
    (_e4m3_tile), takes 128: 0.77 / 0.84 of copy at 64 x 32k / 256 x 4k contexts
    (2026-11-28). 64 tokens in 2 stages read 0.85 / 0.83 there, but made a decode step of 32
    short contexts 3 % slower (6.74 against 6.53 ms, Llama-3.1-8B, twice each in one call);
    what the 64 x 32k case lacks at 128 is splits (four: 0.86). (The sweep covered head_dim
    128.)"""
    tokens = 128 if kv_dtype == torch.float8_e4m3fn else 64
    return DecodeTiles(tile=max(block_size, tokens), num_warps=4, num_stages=3)


# NOTE: the split count and the block table's width change from step to step in eager steps
# (they follow the batch and its longest context); as runtime values, not specialised, they
# cost no compile per new value, which a burst of requests would otherwise pay mid-run.
@triton.jit(
    do_not_specialize=[
        "num_splits",
        "split_balance",
        "min_split_tokens",
        "fixed_split_tokens",
        "max_blocks",
        "stride_table_req",
    ]
)
def _decode_partition_kernel(
    query_ptr,  # [R, H, D]
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, KV, D]
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, KV, D]
    block_tables_ptr,  # [R, max_blocks] int32
    seq_lens_ptr,  # [R] int32
    query_start_loc_ptr,  # [R + 1] int32 with HAS_QUERY_LOC, else unused
    out_ptr,  # [T, H, D], heads and dims contiguous
    part_max_ptr,  # [R, Q, H, S] float32, running max of log2-scaled scores (S > 1)
    part_sum_ptr,  # [R, Q, H, S] float32, sum of exp2(score - max) (S > 1)
    part_acc_ptr,  # [R, Q, H, S, D] float32, unnormalised weighted sum of values (S > 1)
    tickets_ptr,  # [R, KV] int32, zero between launches (S > 1)
    qk_scale,  # softmax scale * log2(e)
    num_splits,  # programs per (request, KV head): the most splits a context may take
    split_balance,  # > 0: splits of about sqrt(split_balance * context) tokens (_split_tokens)
    min_split_tokens,  # the fewest context tokens a split takes (_split_tokens)
    fixed_split_tokens,  # > 0: --batch-invariant's split length (_split_tokens)
    max_blocks,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_req,
    window,  # with WINDOWED: a query sees the last `window` positions up to its own
    sinks_ptr,  # [H] float32 with HAS_SINKS: each head's sink logit
    cap_scale,  # with SOFTCAPPED: softmax scale / cap (qk_scale is then cap * log2(e))
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    QUERIES: tl.constexpr,  # Q: the most query tokens of a request attended (mixed batches)
    GROUP_PAD: tl.constexpr,  # GROUP * QUERIES rounded up to a power of two >= 16, for tl.dot
    GROUP_P2: tl.constexpr,  # GROUP * QUERIES rounded up to a power of two, for the merge
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,  # context tokens per loop step, may span several cache blocks
    DOT_PRECISION: tl.constexpr,
    HAS_QUERY_LOC: tl.constexpr,  # a mixed batch: requests of 1..QUERIES tokens, at their rows
    FP16_DOTS: tl.constexpr,  # an FP8 cache and a bf16 query: both dots in fp16 (see below)
    E4M3_WORDS: tl.constexpr,  # the caches (and their strides) as 32-bit words: _e4m3_tile
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
    WINDOWED: tl.constexpr,  # a sliding window: the splits share only the window's positions
    HAS_SINKS: tl.constexpr,  # a sink logit a head (gpt-oss), added where the output is written
    SOFTCAPPED: tl.constexpr,  # Gemma 2's logit soft-capping: cap * tanh(score * scale / cap)
):
    wait_for_previous_kernel(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token, num_queries = _query_rows(query_start_loc_ptr, req, HAS_QUERY_LOC, QUERIES)
    if token < 0:
        return  # a prompt (chunk) or an empty padding request: the prefill kernel's

    # NOTE: the context is clamped to the table's capacity, so no slot outside the request's
    # own blocks is ever addressed, whatever seq_lens says.
    seq_len = tl.minimum(tl.load(seq_lens_ptr + req), max_blocks * BLOCK_SIZE)
    # What the queries see: from the first query's window on (position 0 without one).
    first = 0
    if WINDOWED:
        first = tl.maximum(seq_len - num_queries - window + 1, 0)
    # The context takes the splits it needs (_split_tokens); the others end here, and take no
    # part in the merge.
    partition_tokens = _split_tokens(
        seq_len - first,
        num_splits,
        split_balance,
        min_split_tokens,
        fixed_split_tokens,
        BLOCK_SIZE,
        TILE,
    )
    live = tl.cdiv(seq_len - first, partition_tokens)  # 1 <= live <= num_splits
    if split >= live:
        return
    split_start = first + split * partition_tokens
    split_end = tl.minimum(split_start + partition_tokens, seq_len)

    rows = tl.arange(0, GROUP_PAD)  # (query token, query head of this KV head) pairs
    dims = tl.arange(0, HEAD_DIM)
    queries = rows // GROUP  # [G] the request's query token of each row
    row_valid = queries < num_queries  # padding rows masked
    heads = kv_head * GROUP + rows % GROUP  # [G]
    # Causal: query token i of n sees the context up to its own position, seq_len - n + i.
    visible_end = seq_len - num_queries + queries + 1  # [G]
    token_rows = (token + queries).to(tl.int64)  # [G] rows of the step's tokens
    q_ptrs = query_ptr + token_rows[:, None] * stride_q_token + heads[:, None] * stride_q_head
    q_ptrs += dims[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None], other=0.0)  # [G, D]
    # An FP8 cache is read in fp16 when the query is bf16: e4m3 -> fp16 is one conversion per
    # pair of values on Hopper (-> bf16 goes through float32), and a bf16 query is exact in
    # fp16 (8 mantissa bits into 11; its values are far inside fp16's range).
    if FP16_DOTS:
        q = q.to(tl.float16)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)

    table_row = block_tables_ptr + req * stride_table_req
    head_offset = kv_head * stride_cache_head
    for tile_start in range(split_start, split_end, TILE):
        pos = tile_start + tl.arange(0, TILE)  # [T] context positions
        pos_valid = pos < split_end
        block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_valid, other=0)  # [T]
        slot_offsets = (
            block_ids.to(tl.int64) * stride_cache_block
            + (pos % BLOCK_SIZE) * stride_cache_slot
            + head_offset
        )  # [T]
        # Masked loads: slots past the context are never read, so garbage there cannot leak.
        # An FP8 cache comes in the dots' dtype (its scales: the caller's).
        if E4M3_WORDS:
            k = _e4m3_tile(key_cache_ptr, slot_offsets, pos_valid, HEAD_DIM)  # [T, D] fp16
            v = _e4m3_tile(value_cache_ptr, slot_offsets, pos_valid, HEAD_DIM)
        else:
            kv_offsets = slot_offsets[:, None] + dims[None, :]  # [T, D]
            k = tl.load(key_cache_ptr + kv_offsets, mask=pos_valid[:, None], other=0.0)
            v = tl.load(value_cache_ptr + kv_offsets, mask=pos_valid[:, None], other=0.0)
            k, v = k.to(q.dtype), v.to(q.dtype)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [G, T]
        if SOFTCAPPED:
            scores = soft_cap(scores, cap_scale)
        scores *= qk_scale
        visible = pos_valid[None, :] & (pos[None, :] < visible_end[:, None])  # [G, T]
        if WINDOWED:
            visible &= pos[None, :] >= visible_end[:, None] - window
        scores = tl.where(visible, scores, float("-inf"))
        # The first tile of a split holds a valid position, but with several queries the last
        # split may lie past an early query's own position: its max stays -inf, and the
        # exponents are taken against 0 then (no inf - inf), leaving its partial empty.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [G]
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)  # [G], 0 on the first step
        p = tl.exp2(scores - m_base[:, None])  # [G, T]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v.dtype), v, input_precision=DOT_PRECISION
        )  # [G, D]
        m_i = m_new

    out_rows = out_ptr + token_rows[:, None] * stride_out_token + heads[:, None] * HEAD_DIM
    out_rows += dims[None, :]
    if live == 1:  # the whole context in split 0, every row's own position with it: l_i > 0
        if HAS_SINKS:
            l_i += _sink_share(sinks_ptr, heads, row_valid, m_i)
        tl.store(
            out_rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_valid[:, None]
        )
        return
    part = ((req * QUERIES + queries) * NUM_HEADS + heads) * num_splits + split  # in [R, Q, H, S]
    tl.store(part_max_ptr + part, m_i, mask=row_valid)
    tl.store(part_sum_ptr + part, l_i, mask=row_valid)
    acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :]
    tl.store(acc_ptrs, acc, mask=row_valid[:, None])
    ticket_ptr = tickets_ptr + req * tl.num_programs(1) + kv_head
    if split_k.last_to_arrive(ticket_ptr, live):
        group_out = out_ptr + token.to(tl.int64) * stride_out_token + kv_head * GROUP * HEAD_DIM
        first_part = (req * QUERIES * NUM_HEADS + kv_head * GROUP) * num_splits
        _merge_splits(
            group_out, stride_out_token, part_max_ptr, part_sum_ptr, part_acc_ptr, first_part,
            num_splits, live, num_queries, sinks_ptr + kv_head * GROUP, NUM_HEADS, GROUP,
            GROUP_P2, HEAD_DIM, HAS_SINKS,
        )  # fmt: skip
        tl.store(ticket_ptr, 0)  # zero again for the next launch (and graph replay)


@triton.jit
def _split_tokens(
    seq_len,
    num_splits,
    split_balance,
    min_split_tokens,
    fixed_split_tokens,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
):
    """Context tokens a split of this request. An even share, `even`: seq_len / num_splits in
    whole blocks (at least one), so that the launch's splits hold it all. Without
    split_balance, the most of that and min_split_tokens. With it (a batch that leaves SMs
    free, `_split_rule`), about sqrt(split_balance * seq_len) in whole tiles where the launch
    has that many splits: it weighs each split's loop against the merge's walk over every
    split's partials; else `even` for a context within half the table's width (the launch's
    splits times min_split_tokens), and the table's share only for longer ones (near the width
    `even` ran slower: `_split_rule`). With fixed_split_tokens (--batch-invariant), that many,
    doubled while the launch's splits cannot hold the context: a function of seq_len alone
    where the launch has MAX_SPLITS splits or the table fits its splits unchanged."""
    even = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_SIZE), 1) * BLOCK_SIZE
    by_width = tl.maximum(even, min_split_tokens)
    balanced = tl.sqrt((split_balance * seq_len).to(tl.float32)).to(tl.int32)
    balanced = tl.maximum(tl.cdiv(balanced, TILE), 1) * TILE
    fits = tl.cdiv(seq_len, balanced) <= num_splits
    short = 2 * seq_len <= num_splits * min_split_tokens
    free = split_balance > 0
    picked = tl.where(free & fits, balanced, tl.where(free & short, even, by_width))
    fixed = tl.maximum(fixed_split_tokens, 1)
    over = tl.cdiv(seq_len, fixed * num_splits)  # 1 while the splits hold the context
    doublings = tl.ceil(tl.log2(over.to(tl.float32))).to(tl.int32)
    return tl.where(fixed_split_tokens > 0, fixed << doublings, picked)


@triton.jit
def _merge_splits(
    out_ptr,  # the first query token's output row, at this KV head's first query head
    stride_out_token,
    part_max_ptr,  # [R, Q, H, S] float32
    part_sum_ptr,  # [R, Q, H, S] float32
    part_acc_ptr,  # [R, Q, H, S, D] float32
    first_part,  # index of (request, query 0, first head of the group, split 0) in [R, Q, H, S]
    num_splits,
    live,  # splits that hold context, 1 <= live <= num_splits
    num_queries,  # the request's query tokens, 1 <= num_queries <= QUERIES
    group_sinks_ptr,  # with HAS_SINKS: the sink logit of the group's first query head
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,  # GROUP * QUERIES rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """The output of every (query token, query head of the group) pair from its live splits'
    partials, all pairs at once (a verifying row's queries merged one after another cost some
    4 us a layer at batch 1), CHUNK splits a step, in split order (the same sum whichever
    program merges). Partials are read past L1 (.cg): other programs wrote them."""
    # [CHUNK, GROUP_P2, D] of 4,096 values a step, and one split a step for 256-wide heads:
    # compiled for sm_90 (Triton 3.9, on the CPU), larger chunks there raised the kernel's
    # registers a thread above what its attention loop needs (195 against 150 at any chunk
    # of 2 or more); 128-wide heads take 90 at chunks of 8.
    CHUNK: tl.constexpr = 1 if HEAD_DIM >= 256 else max(1, 4096 // (GROUP_P2 * HEAD_DIM))
    pairs = tl.arange(0, GROUP_P2)
    queries, heads = pairs // GROUP, pairs % GROUP
    dims = tl.arange(0, HEAD_DIM)
    chunk = tl.arange(0, CHUNK)
    g_valid = queries < num_queries
    pair_part = first_part + (queries * NUM_HEADS + heads) * num_splits  # [G] split 0's
    m_run = tl.zeros([GROUP_P2], tl.float32) + float("-inf")
    l_run = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    for first in range(0, live, CHUNK):
        splits = first + chunk  # [C]
        valid = (splits < live)[:, None] & g_valid[None, :]  # [C, G]
        part = pair_part[None, :] + splits[:, None]  # [C, G]
        m = tl.load(part_max_ptr + part, mask=valid, other=float("-inf"), cache_modifier=".cg")
        m = tl.where(g_valid[None, :], m, 0.0)  # padding pairs: finite, never stored
        s = tl.load(part_sum_ptr + part, mask=valid, other=0.0, cache_modifier=".cg")
        a_ptrs = part_acc_ptr + part[:, :, None] * HEAD_DIM + dims[None, None, :]
        a = tl.load(a_ptrs, mask=valid[:, :, None], other=0.0, cache_modifier=".cg")  # [C, G, D]
        # A split past a query's position, or (in a window) before its window, has m = -inf:
        # weight 0; while every split so far has, the exponents are taken against 0.
        m_new = tl.maximum(m_run, tl.max(m, axis=0))  # [G]
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_base)  # 0 on the first chunk
        w = tl.exp2(m - m_base[None, :])  # [C, G], 0 for the masked splits past `live`
        l_run = l_run * alpha + tl.sum(s * w, axis=0)
        acc = acc * alpha[:, None] + tl.sum(a * w[:, :, None], axis=0)
        m_run = m_new
    if HAS_SINKS:
        l_run += _sink_share(group_sinks_ptr, heads, g_valid, m_run)
    out = acc / tl.where(g_valid, l_run, 1.0)[:, None]  # padding pairs: 0, never stored
    rows = queries.to(tl.int64) * stride_out_token + heads * HEAD_DIM
    out_ptrs = out_ptr + rows[:, None] + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_valid[:, None])


@triton.jit
def _sink_share(sinks_ptr, heads, valid, m):
    """exp(sink - max) of each row's head, in the log2 units of the running max m: what the
    sink adds to the softmax's denominator."""
    sink = tl.load(sinks_ptr + heads, mask=valid, other=0.0).to(tl.float32)
    return tl.exp2(sink * 1.4426950408889634 - m)


# Four e4m3 values (one 32-bit word: $4) to fp16: a CVT turns each half of the word into an
# fp16 pair (exact: every e4m3 value is an fp16 value); $0-$3 are the values of bytes 0-3.
_E4M3_WORD_ASM = tl.constexpr("""
{
.reg .b16 lo, hi;
.reg .b32 pair;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 pair, lo;
mov.b32 {$0, $1}, pair;
cvt.rn.f16x2.e4m3x2 pair, hi;
mov.b32 {$2, $3}, pair;
}
""")


@triton.jit
def _e4m3_tile(cache_words_ptr, slot_offsets, pos_valid, HEAD_DIM: tl.constexpr):
    """The [T, D] fp16 tile of an e4m3 cache read as 32-bit words ([T, D / 4], offsets in
    words). Converted by inline PTX, the tile reaches the dots as fp16 through vector moves;
    left to Triton, the e4m3 tile went through shared memory a byte at a time (for v, an
    8-bit operand along the dot's N, which ldmatrix cannot transpose)."""
    words = tl.arange(0, HEAD_DIM // 4)
    word_ptrs = cache_words_ptr + slot_offsets[:, None] + words[None, :]
    packed = tl.load(word_ptrs, mask=pos_valid[:, None], other=0)  # [T, D / 4] int32
    b0, b1, b2, b3 = tl.inline_asm_elementwise(
        _E4M3_WORD_ASM,
        "=h,=h,=h,=h,r",
        [packed],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=1,
    )
    tile = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [T, D / 4, 2, 2]: value 4w + 2i + j
    return tl.reshape(tile, [slot_offsets.shape[0], HEAD_DIM])


@triton.jit
def _query_rows(query_start_loc_ptr, req, HAS_QUERY_LOC: tl.constexpr, QUERIES: tl.constexpr):
    """Request req's first query row and its number of query tokens; row -1 in a mixed batch
    where it has none or more than QUERIES."""
    if not HAS_QUERY_LOC:
        return req, 1
    start = tl.load(query_start_loc_ptr + req)
    count = tl.load(query_start_loc_ptr + req + 1) - start
    return tl.where((count >= 1) & (count <= QUERIES), start, -1), count


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_num_splits(
    num_reqs: int,
    num_kv_heads: int,
    max_blocks: int,
    block_size: int,
    device: torch.device,
    tile: int,
) -> int:
    """Enough programs for a few waves of 64-token steps on the GPU (fewer programs where each
    step reads more), within `most_splits`."""
    wanted = triton.cdiv(4 * _sms(device) * 64 // max(tile, 64), num_reqs * num_kv_heads)
    return max(1, min(wanted, most_splits(max_blocks, block_size, tile)))


def _sms(device: torch.device) -> int:
    """The device's SMs; 8 for a CPU (the interpreter's tests)."""
    return _num_sms(device.index or 0) if device.type == "cuda" else 8


def _split_rule(pairs: int, device: torch.device) -> int:
    """The split_balance of picked splits (`_split_tokens`): SPLIT_BALANCE with no more
    (request, KV head) pairs than SMs, else 0. With more, the batch fills the GPU, and
    splitting shorter contexts only added merges (32 x 1,024 tokens in a 131,072-token table,
    H200). Near the table's width a small batch keeps the table's share too: 8 or 12 contexts
    as long as the table, in as many splits as launched, ran 14-27 % slower in splits of 448
    or 656 tokens than of 464 or 688, for reasons not found."""
    return SPLIT_BALANCE if pairs <= _sms(device) else 0


def most_splits(max_blocks: int, block_size: int, tile: int) -> int:
    """The most splits worth making of a context of `max_blocks` blocks: none shorter than
    MIN_PARTITION_TOKENS or one tile (a shorter split would compute a mostly masked tile),
    nor than a block, and at most MAX_SPLITS."""
    useful = triton.cdiv(max_blocks * block_size, max(MIN_PARTITION_TOKENS, tile))
    return max(1, min(useful, max_blocks, MAX_SPLITS))


def _check_shapes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor):
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if key_cache.shape[3] != head_dim or value_cache.shape != key_cache.shape:
        raise ValueError("key_cache and value_cache must be [num_blocks, block_size, kv, D]")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(3) != 1:
        raise ValueError("key_cache and value_cache need the same strides, head_dim contiguous")
    if query.stride(2) != 1:
        raise ValueError("query must be contiguous in head_dim")


def paged_decode_attention(
    query: torch.Tensor,  # [num_reqs, num_heads, head_dim]; [num_tokens, ...] with query_start_loc
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, context length including the query token
    scale: float,
    num_splits: int | None = None,  # the most split-KV partitions; None: picked (below)
    *,
    query_start_loc: torch.Tensor | None = None,  # [num_reqs + 1] int32: a mixed batch
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim] to write into
    tiles: DecodeTiles | None = None,  # None: default_decode_tiles for the cache
    max_queries: int = 1,  # with query_start_loc: the most query tokens of a request attended
    window: int | None = None,  # a sliding window: a query sees its last `window` positions
    sinks: torch.Tensor | None = None,  # [num_heads] float32: each head's sink logit
    softcap: float | None = None,  # scores become softcap * tanh(score / softcap) (Gemma 2)
) -> torch.Tensor:  # out, or a new [num_tokens, num_heads, head_dim] of query.dtype
    """Decode attention over a paged KV cache; every seq_lens[r] must be >= 1. With a window
    the splits share the window's positions only: the context before it is not read.

    With query_start_loc, only requests with 1 to `max_queries` query tokens are attended
    (causally: the last at seq_lens[r] - 1), at their rows; the other rows of the result are
    left as they were (see the module docstring).
    `num_splits` is the most splits a context may take. By default it is picked from the
    batch and the block table's capacity, not max(seq_lens), so no device-to-host sync is
    needed, and each request sizes its splits on the device (`_split_tokens`); a given count
    cuts each context into at most that many, as even as whole blocks allow. Splits past a
    context end at once, and a context that fits the first split is written by it directly,
    with no merge.
    """
    _check_shapes(query, key_cache, value_cache)
    num_reqs = seq_lens.shape[0]
    _check_rows(query, num_reqs, query_start_loc, out)
    if max_queries < 1 or (max_queries > 1 and query_start_loc is None):
        raise ValueError(f"max_queries {max_queries}: 1, or more with query_start_loc")
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if tiles is None:
        tiles = default_decode_tiles(key_cache.dtype, block_size)
    max_blocks = block_tables.shape[1]
    invariant = batch_invariant(query.shape[0])
    splits = _splits(
        num_splits, num_reqs, num_kv_heads, max_blocks, block_size, query.device, tiles.tile,
        invariant,
    )  # fmt: skip

    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)  # [T, H, D]
    if num_reqs == 0:
        return out
    _launch_partitions(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, scale,
        splits, tiles, max_queries, window, sinks, softcap,
    )  # fmt: skip
    return out


def _launch_partitions(
    query: torch.Tensor,  # [R, H, D]; [T, H, D] with query_start_loc
    key_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    block_tables: torch.Tensor,  # [R, max_blocks] int
    seq_lens: torch.Tensor,  # [R] int
    query_start_loc: torch.Tensor | None,  # [R + 1] int: a mixed batch
    out: torch.Tensor,  # [T, H, D], contiguous
    scale: float,
    splits: tuple[int, int, int, int],  # _splits
    tiles: DecodeTiles,
    max_queries: int,
    window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> None:
    """One launch of the partition kernel, a program per (request, KV head, split), on int32
    metadata, with the partials it merges through."""
    num_reqs, num_kv_heads, num_splits = seq_lens.shape[0], key_cache.shape[2], splits[0]
    block_tables = block_tables.to(torch.int32).contiguous()  # [R, max_blocks]
    seq_lens = seq_lens.to(torch.int32).contiguous()
    has_query_loc = query_start_loc is not None
    query_loc = query_start_loc.to(torch.int32).contiguous() if has_query_loc else seq_lens
    partials = _partials(out, num_reqs, num_kv_heads, num_splits, max_queries)
    words = _reads_e4m3_words(query, key_cache, value_cache)
    padded_queries = INVARIANT_MAX_ROWS if splits[3] > 0 else max_queries
    constants = _partition_constants(query, key_cache, tiles, has_query_loc, words, max_queries)
    # Invariant: one row shape whatever the queries, so each row's sums take one order.
    constants.update(_query_pads(constants["GROUP"], padded_queries))
    constants.update(
        WINDOWED=window is not None, HAS_SINKS=sinks is not None, SOFTCAPPED=softcap is not None
    )
    if words:  # the caches as 32-bit words of four values, their strides in words
        key_cache, value_cache = key_cache.view(torch.int32), value_cache.view(torch.int32)
    args = _partition_args(
        query, key_cache, value_cache, block_tables, seq_lens, query_loc, out, partials, scale,
        splits, window, sinks, softcap,
    )  # fmt: skip
    # Shared memory for the stages asked, or fewer where the GPU has less (kernels/triton_stages).
    variant = ("decode_partition", query.device, query.dtype, key_cache.dtype, *constants.values())
    grid = (num_reqs, num_kv_heads, num_splits)
    launch_fitting(
        variant,
        tiles.num_stages,
        lambda stages: _decode_partition_kernel[grid](*args, **constants, num_stages=stages),
    )


def _partition_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,  # as the kernel reads it: 32-bit words where it reads e4m3 words
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, max_blocks] int32, contiguous
    seq_lens: torch.Tensor,  # [R] int32, contiguous
    query_loc: torch.Tensor,  # [R + 1] int32 query_start_loc; seq_lens without one
    out: torch.Tensor,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],  # _partials
    scale: float,
    splits: tuple[int, int, int, int],  # _splits
    window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> tuple:
    """The partition kernel's runtime arguments, in its order."""
    part_max, part_sum, part_acc, tickets = partials
    num_splits, split_balance, min_split_tokens, fixed_split_tokens = splits
    return (
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_loc,
        out,
        part_max,
        part_sum,
        part_acc,
        tickets,
        scores_log2_scale(scale, softcap),
        num_splits,
        split_balance,
        min_split_tokens,
        fixed_split_tokens,
        block_tables.shape[1],  # max_blocks
        query.stride(0),
        query.stride(1),
        out.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        window or 0,
        sinks if sinks is not None else seq_lens,
        scale / softcap if softcap is not None else 0.0,
    )


def _partition_constants(
    query: torch.Tensor,  # [R or T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], as given (not as words)
    tiles: DecodeTiles,
    has_query_loc: bool,
    words: bool,  # _reads_e4m3_words
    max_queries: int,
) -> dict:
    """The partition kernel's compile-time constants and launch options."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    early = launches_early(query)
    fp8_cache = key_cache.dtype == torch.float8_e4m3fn
    return dict(
        NUM_HEADS=num_heads,
        GROUP=group,
        QUERIES=max_queries,
        **_query_pads(group, max_queries),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE=tiles.tile,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        HAS_QUERY_LOC=has_query_loc,
        FP16_DOTS=fp8_cache and query.dtype == torch.bfloat16,
        E4M3_WORDS=words,
        PDL=early,
        num_warps=tiles.num_warps,
        launch_pdl=early,
    )


def _query_pads(group: int, queries: int) -> dict[str, int]:
    """The rows the kernel pads a request's (query token, head) pairs to: a power of two for
    the merge, and at least 16 for tl.dot."""
    pairs = triton.next_power_of_2(group * queries)
    return dict(GROUP_PAD=max(16, pairs), GROUP_P2=pairs)


def _splits(
    num_splits: int | None,
    num_reqs: int,
    num_kv_heads: int,
    max_blocks: int,
    block_size: int,
    device: torch.device,
    tile: int,
    invariant: bool,  # kernels.invariance.batch_invariant
) -> tuple[int, int, int, int]:  # (num_splits, split_balance, min_split_tokens, fixed tokens)
    """The launch's splits and how a request sizes its share (`_split_tokens`): a given count
    evenly; a picked one by `_split_rule`, with the table's share as the floor; invariant,
    in splits of a fixed length (so that a query's splits depend on nothing but its position)."""
    if num_splits is not None:
        return max(1, min(num_splits, max_blocks)), 0, 0, 0
    if invariant:
        fixed = max(INVARIANT_SPLIT_TOKENS, tile)
        count = min(MAX_SPLITS, triton.cdiv(max_blocks * block_size, fixed))
        return count, 0, 0, fixed
    picked = pick_num_splits(num_reqs, num_kv_heads, max_blocks, block_size, device, tile)
    width_share = triton.cdiv(max_blocks, picked) * block_size
    return picked, _split_rule(num_reqs * num_kv_heads, device), width_share, 0


def _partials(
    out: torch.Tensor,  # [T, H, D]
    num_reqs: int,
    num_kv_heads: int,
    num_splits: int,
    max_queries: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # max, sum, acc, tickets
    """What the partition kernel merges through with several splits: float32 partials per
    (request, query token, query head, split) and a ticket counter per (request, KV head).
    With one split it writes the output at once and touches none of them: empty tensors of
    their dtypes stand in (the kernel specialises on its pointers' dtypes)."""
    if num_splits == 1:
        empty = torch.empty(0, dtype=torch.float32, device=out.device)
        return empty, empty, empty, torch.empty(0, dtype=torch.int32, device=out.device)
    counters = split_k.tickets(out.device, num_reqs * num_kv_heads, "decode attention")
    num_heads, head_dim = out.shape[1], out.shape[2]
    f32 = dict(device=out.device, dtype=torch.float32)
    rows = num_reqs * max_queries
    part_max = torch.empty(rows, num_heads, num_splits, **f32)  # [R * Q, H, S]
    part_sum = torch.empty(rows, num_heads, num_splits, **f32)  # [R * Q, H, S]
    part_acc = torch.empty(rows, num_heads, num_splits, head_dim, **f32)  # [R * Q, H, S, D]
    return part_max, part_sum, part_acc, counters


@functools.cache
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def reads_e4m3_words_on(tensor: torch.Tensor) -> bool:
    """Whether decode attention on `tensor`'s device reads an e4m3 cache as words: CUDA from
    Hopper on. The conversion (_E4M3_WORD_ASM) runs from Ada (8.9) on, but there the word
    tiles of 128-dim heads fit a block's 99 KB only unpipelined (1 stage: 69,632 bytes,
    tests/kernels/target_compile.py), which no Ada GPU has measured; Ada reads bytes. Never
    under TRITON_INTERPRET, which runs no assembly."""
    return tensor.is_cuda and _hopper_or_later(tensor.device.index or 0)


WORDS_MAX_HEAD_DIM = 128  # the head sizes measured with words (larger ones read bytes)


def _reads_e4m3_words(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor):
    """Whether the partition kernel reads an e4m3 cache as words through _e4m3_tile: where
    `reads_e4m3_words_on`, for a 16-bit query and heads of up to WORDS_MAX_HEAD_DIM, from
    caches whose rows start on 4-byte boundaries."""
    if key_cache.dtype != torch.float8_e4m3fn or not reads_e4m3_words_on(query):
        return False
    if query.shape[2] > WORDS_MAX_HEAD_DIM:
        return False
    aligned = all(
        c.data_ptr() % 4 == 0 and all(s % 4 == 0 for s in c.stride()[:3])
        for c in (key_cache, value_cache)
    )
    return aligned and query.dtype in (torch.bfloat16, torch.float16)


def compile_every_variant(
    query: torch.Tensor,  # [>= 1, num_heads, head_dim], the model's dtype
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    max_queries: int = 1,  # the engine's mixed steps' (1 + speculative tokens)
    window: int | None = None,  # the model's sliding window, where it has one
    softcap: float | None = None,  # the model's attention logit soft-cap, where it has one
) -> None:
    """Launch the kernel with one and two splits, with and without a mixed batch (of up to
    `max_queries` tokens a request), on one request of one cached token (block 0, read only),
    so that no step of a running server meets a variant it has to compile first (the split
    count and table width are runtime values). (The ticket counters are made by the first
    eager launch with splits; a graph's capture follows an eager run of the same step,
    cuda_graphs.StepGraphs.capture.)"""
    device = query.device
    tables = torch.zeros(1, 2, dtype=torch.int32, device=device)  # block 0: read only
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    mixed = torch.tensor([0, 1], dtype=torch.int32, device=device)
    for splits, query_start_loc in itertools.product((1, 2), (None, mixed)):
        paged_decode_attention(
            query[:1], key_cache, value_cache, tables, seq_lens, 1.0, splits,
            query_start_loc=query_start_loc,
            max_queries=max_queries if query_start_loc is not None else 1, window=window,
            softcap=softcap,
        )  # fmt: skip


def _check_rows(
    query: torch.Tensor,
    num_reqs: int,
    query_start_loc: torch.Tensor | None,
    out: torch.Tensor | None,
) -> None:
    if query_start_loc is None and query.shape[0] != num_reqs:
        raise ValueError(
            f"query has {query.shape[0]} rows for {num_reqs} requests: one token per request,"
            " or pass query_start_loc"
        )
    if query_start_loc is not None and query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(f"query_start_loc must be [{num_reqs + 1}], got {query_start_loc.shape}")
    if out is not None and (
        out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous()
    ):
        raise ValueError(f"out must be a contiguous {query.dtype} {tuple(query.shape)} tensor")
