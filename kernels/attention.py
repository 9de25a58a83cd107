"""Attention over a paged KV cache, for mixed batches of prefill chunks and decodes.

Each request r owns query tokens query_start_loc[r]:query_start_loc[r+1] of the flat
batch; its context is seq_lens[r] tokens long and ends with those queries:

    context  [---------- cached / earlier -----------|====== this step's queries ======]
             0                           seq_lens[r] - num_queries[r]           seq_lens[r]

Query i of request r sees context positions <= seq_lens[r] - num_queries[r] + i (causal); with
a sliding window of W tokens, only the last W of them (its own position and the W - 1 before).
With attention sinks (gpt-oss), head h's softmax has one more logit, sinks[h], that takes
its share of the weights and has no value: the output is scaled by
sum exp(s) / (sum exp(s) + exp(sinks[h])) over the visible scores s. With soft-capping
(Gemma 2), each scaled score s becomes softcap * tanh(s / softcap) before the softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The Triton prefill kernel holds a step's requests in one vector of a power of two: one compile
# serves every step of up to this many requests, and past it each power of two is a compile of
# its own (kernels/triton_prefill_attention.py; services/executor/runner/warm_up.py meets them at
# start).
PREFILL_REQS_MIN_POW2 = 256


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int
    seq_lens: torch.Tensor,  # [num_reqs] int
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    window: int | None = None,  # a sliding window: each query sees its last `window` positions
    sinks: torch.Tensor | None = None,  # [num_heads] float32: each head's sink logit
    softcap: float | None = None,  # scores become softcap * tanh(score / softcap)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens = query.shape[0]
    device = query.device
    num_queries = query_start_loc[1:] - query_start_loc[:-1]  # [R]

    # Pad the flat queries into [R, max_query_len].
    q_offsets = torch.arange(max_query_len, device=device)
    q_valid = q_offsets[None, :] < num_queries[:, None]  # [R, Q]
    q_index = (query_start_loc[:-1, None] + q_offsets[None, :]).clamp(max=num_tokens - 1)
    q = query[q_index]  # [R, Q, H, D]

    positions = torch.arange(max_seq_len, device=device)
    k, v = _gather_context(key_cache, value_cache, block_tables, seq_lens, positions, query)

    first_query_pos = (seq_lens - num_queries)[:, None]  # [R, 1]
    query_pos = first_query_pos + q_offsets[None, :]  # [R, Q]
    visible = positions[None, None, :] <= query_pos[:, :, None]  # [R, Q, S]
    if window is not None:
        visible &= positions[None, None, :] > query_pos[:, :, None] - window
    # Padding rows see position 0 only, so softmax stays finite; they are dropped below.
    visible |= ~q_valid[:, :, None] & (positions == 0)[None, None, :]

    if softcap is not None:
        out = _softcapped_attention(q, k, v, visible, scale, softcap)  # [R, Q, H, D]
    else:
        out = _grouped_attention(q, k, v, visible, scale)  # [R, Q, H, D]
    if sinks is not None:
        out = out * _sink_factor(q, k, visible, scale, sinks, softcap).to(out.dtype)
    return _flat_rows(out, query_start_loc, num_queries, num_tokens)


def _sink_factor(
    q: torch.Tensor,  # [R, Q, H, D]
    k: torch.Tensor,  # [R, S, KV, D]
    visible: torch.Tensor,  # [R, Q, S] bool
    scale: float,
    sinks: torch.Tensor,  # [H]
    softcap: float | None = None,
) -> torch.Tensor:  # [R, Q, H, 1]: sum exp(s) / (sum exp(s) + exp(sink)) = sigmoid(lse - sink)
    scores = _scores(q, k, visible, scale, softcap)  # [R, Q, H, S]
    lse = torch.logsumexp(scores, dim=-1)  # [R, Q, H]
    return torch.sigmoid(lse - sinks.float()[None, None, :])[..., None]


def _scores(
    q: torch.Tensor,  # [R, Q, H, D]
    k: torch.Tensor,  # [R, S, KV, D]
    visible: torch.Tensor,  # [R, Q, S] bool
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [R, Q, H, S] float32, -inf where not visible
    group = q.shape[2] // k.shape[2]
    keys = k.repeat_interleave(group, dim=2).float()  # [R, S, H, D]
    scores = torch.einsum("rqhd,rshd->rqhs", q.float(), keys) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    return scores.masked_fill(~visible[:, :, None, :], float("-inf"))


def _softcapped_attention(
    q: torch.Tensor,  # [R, Q, H, D]
    k: torch.Tensor,  # [R, S, KV, D]
    v: torch.Tensor,  # [R, S, KV, D]
    visible: torch.Tensor,  # [R, Q, S] bool
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [R, Q, H, D]
    """Attention with soft-capped scores, in float32 (no fused kernel takes the cap)."""
    weights = _scores(q, k, visible, scale, softcap).softmax(dim=-1)  # [R, Q, H, S]
    group = q.shape[2] // k.shape[2]
    values = v.repeat_interleave(group, dim=2).float()  # [R, S, H, D]
    return torch.einsum("rqhs,rshd->rqhd", weights, values).to(q.dtype)


def _gather_context(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [R, max_blocks_per_req] int
    seq_lens: torch.Tensor,  # [R] int
    positions: torch.Tensor,  # [S]: 0 .. max_seq_len - 1
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the dtype and head_dim read
) -> tuple[torch.Tensor, torch.Tensor]:  # k, v: [R, S, KV, D] of query.dtype
    """Each request's context, gathered from its blocks."""
    head_dim = query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    # Slots past a context hold stale or uninitialised memory (NaN * 0 would still poison the
    # sum): read the request's first slot there instead, which is finite and masked out anyway.
    blocks = block_tables[:, positions // block_size].long()  # [R, S]
    slots = blocks * block_size + positions % block_size  # [R, S]
    slots = torch.where(positions[None, :] < seq_lens[:, None], slots, slots[:, :1])
    # An FP8 cache is read back in the query's dtype (its scales, if any, are the caller's:
    # the softmax scale and the output carry them).
    k = key_cache.reshape(-1, num_kv_heads, head_dim)[slots].to(query.dtype)  # [R, S, KV, D]
    v = value_cache.reshape(-1, num_kv_heads, head_dim)[slots].to(query.dtype)  # [R, S, KV, D]
    return k, v


def _grouped_attention(
    q: torch.Tensor,  # [R, Q, H, D]
    k: torch.Tensor,  # [R, S, KV, D]
    v: torch.Tensor,  # [R, S, KV, D]
    visible: torch.Tensor,  # [R, Q, S] bool
    scale: float,
) -> torch.Tensor:  # [R, Q, H, D]
    """GQA: the `group` query heads of one KV head attend together, as one longer query
    block, so keys and values are never copied per query head."""
    num_reqs, max_query_len, num_heads, head_dim = q.shape
    num_kv_heads, max_seq_len = k.shape[2], k.shape[1]
    group = num_heads // num_kv_heads
    q = q.view(num_reqs, max_query_len, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(num_reqs, num_kv_heads, group * max_query_len, head_dim)
    mask = visible[:, None].expand(num_reqs, group, max_query_len, max_seq_len)
    out = F.scaled_dot_product_attention(
        q,  # [R, KV, G*Q, D]
        k.transpose(1, 2),  # [R, KV, S, D]
        v.transpose(1, 2),  # [R, KV, S, D]
        attn_mask=mask.reshape(num_reqs, 1, group * max_query_len, max_seq_len),
        scale=scale,
    )  # [R, KV, G*Q, D]
    out = out.view(num_reqs, num_kv_heads, group, max_query_len, head_dim)
    return out.permute(0, 3, 1, 2, 4).reshape(num_reqs, max_query_len, num_heads, head_dim)


def _flat_rows(
    out: torch.Tensor,  # [R, Q, H, D]
    query_start_loc: torch.Tensor,  # [R + 1] int
    num_queries: torch.Tensor,  # [R]
    num_tokens: int,
) -> torch.Tensor:  # [num_tokens, H, D]
    """Back to the flat layout by index arithmetic: a boolean mask would cost a device-to-host
    sync in every layer, leaving the GPU idle while the host catches up. Tokens past the last
    request's (a CUDA graph's padding, which belongs to no request) get zeros."""
    num_reqs, device = out.shape[0], out.device
    starts = query_start_loc.long()
    counts = torch.cat([num_queries.long(), num_tokens - starts[-1:]])  # + the padding's
    requests = torch.arange(num_reqs + 1, device=device)
    token_req = torch.repeat_interleave(requests, counts, output_size=num_tokens)
    token_offset = torch.arange(num_tokens, device=device) - starts[token_req]
    token_offset = torch.where(token_req < num_reqs, token_offset, 0)  # padding: the zero row
    out = torch.cat([out, out.new_zeros(1, *out.shape[1:])])
    return out[token_req, token_offset]  # [num_tokens, H, D]


def contiguous_attention_reference(
    query: torch.Tensor,  # [num_queries, num_heads, head_dim], the last queries of the context
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_queries, num_heads, head_dim]
    """Naive causal attention of one request over a contiguous context (test oracle)."""
    num_queries, num_heads, _ = query.shape
    seq_len = key.shape[0]
    group = num_heads // key.shape[1]
    k = key.repeat_interleave(group, dim=1).float()  # [S, H, D]
    v = value.repeat_interleave(group, dim=1).float()  # [S, H, D]
    scores = torch.einsum("qhd,shd->hqs", query.float(), k) * scale  # [H, Q, S]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query_pos = torch.arange(seq_len - num_queries, seq_len)[:, None]  # [Q, 1]
    mask = torch.arange(seq_len)[None, :] > query_pos  # [Q, S]
    if window is not None:
        mask |= torch.arange(seq_len)[None, :] <= query_pos - window
    scores = scores.masked_fill(mask[None], float("-inf"))
    out = torch.einsum("hqs,shd->qhd", scores.softmax(dim=-1), v)  # [Q, H, D]
    return out.to(query.dtype)
