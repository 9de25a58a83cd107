"""The kernel entry points the executor calls: Triton on CUDA tensors, torch references elsewhere
(the quantized linear layers': kernels/quantized_ops.py).

Each Triton kernel has the signature of its reference. The Triton modules are imported on
first use on a GPU, so CPU-only processes never import triton.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from kernels.activation import (
    gelu_tanh_and_mul_fp8_reference,
    gelu_tanh_and_mul_reference,
    silu_and_mul_fp8_reference,
    silu_and_mul_reference,
)
from kernels.all_gather import all_gather_reference
from kernels.all_reduce_norm import all_reduce_add_rms_norm_reference
from kernels.argmax import argmax_reference
from kernels.attention import paged_attention_reference
from kernels.embedding import embedding_rows_reference
from kernels.fp8 import Fp8Rows
from kernels.inputs import (
    catch_up_rows_reference,
    draft_pass_inputs_reference,
    gather_sampled_inputs_reference,
    next_token_ids_reference,
)
from kernels.int4 import Int4Stack
from kernels.linear import linear_reference
from kernels.lora import LoraDelta, lora_expand_reference, lora_shrink_reference
from kernels.moe import (
    ClampedSwiglu,
    ExpertBiases,
    moe_experts_int4_reference,
    moe_experts_reference,
    moe_route_reference,
)
from kernels.norm import (
    fused_add_rms_norm_fp8_reference,
    fused_add_rms_norm_reference,
    fused_norm_add_rms_norm_reference,
    rms_norm_fp8_reference,
    rms_norm_pair_reference,
    rms_norm_reference,
)
from kernels.peers import PeerBuffers
from kernels.rotary_cache import rotary_write_kv_reference

_modules: dict[str, ModuleType] = {}


def triton_module(name: str, tensor: torch.Tensor) -> ModuleType | None:
    """The Triton module `kernels.triton_<name>` when `tensor` is on CUDA, else None."""
    if not tensor.is_cuda:
        return None
    module = _modules.get(name)
    if module is None:
        module = _modules[name] = importlib.import_module(f"kernels.triton_{name}")
    return module


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    decode_queries: int = 1,  # the most query tokens of a request the decode kernel takes
    window: int | None = None,  # a sliding window: a query sees its last `window` positions
    sinks: torch.Tensor | None = None,  # [num_heads] float32: each head's sink logit (gpt-oss)
    softcap: float | None = None,  # scores become softcap * tanh(score / softcap) (Gemma 2)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    args = (query, key_cache, value_cache, block_tables, seq_lens)
    extras = dict(window=window, sinks=sinks, softcap=softcap)
    decode = triton_module("decode_attention", query)
    if max_query_len == 1 and decode is not None:
        # One query per request: the split-KV kernel, which fills the GPU at batch 1 too.
        return decode.paged_decode_attention(*args, scale, **extras)
    if decode is not None and (prefill := triton_module("prefill_attention", query)) is not None:
        # A mixed batch: prompts through the prefill kernel, and the decodes riding along
        # (with their drafts, when speculating) through the split-KV kernel, which reads their
        # contexts with many programs each, once for all of a request's query tokens.
        out = None
        if max_query_len > decode_queries:
            out = prefill.paged_prefill_attention(
                *args, query_start_loc, max_query_len, max_seq_len, scale,
                skip_queries_up_to=decode_queries, **extras,
            )  # fmt: skip
        return decode.paged_decode_attention(
            *args, scale, query_start_loc=query_start_loc, out=out, max_queries=decode_queries,
            **extras,
        )  # fmt: skip
    return paged_attention_reference(
        *args, query_start_loc, max_query_len, max_seq_len, scale, window, sinks, softcap
    )


def compile_attention_variants(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    decode_queries: int,
    windows: tuple[int | None, ...] = (None,),  # the model's layers' windows
    softcap: float | None = None,  # the model's attention logit soft-cap
) -> None:
    """Compile now the attention kernel variants a step may need later (CUDA; on the CPU
    nothing is compiled)."""
    decode = triton_module("decode_attention", query)
    if decode is not None:
        for window in windows:
            decode.compile_every_variant(
                query, key_cache, value_cache, decode_queries, window, softcap
            )


def embedding_rows(ids: torch.Tensor, weight: torch.Tensor, first_id: int) -> torch.Tensor:
    """[T, hidden]: each id's row of `weight` (rows first_id ..), zeros for ids it lacks."""
    module = triton_module("embedding", weight)
    kernel = module.embedding_rows if module is not None else embedding_rows_reference
    return kernel(ids, weight, first_id)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    module = triton_module("norm", x)
    return (module.rms_norm if module is not None else rms_norm_reference)(x, weight, eps)


def rms_norm_pair(
    a: torch.Tensor, a_weight: torch.Tensor, b: torch.Tensor, b_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """[T, 2 * hidden]: the norms of a and of b side by side, in one kernel."""
    module = triton_module("norm", a)
    kernel = module.rms_norm_pair if module is not None else rms_norm_pair_reference
    return kernel(a, a_weight, b, b_weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, x + residual); the Triton version writes both in place of its inputs."""
    module = triton_module("norm", x)
    kernel = module.fused_add_rms_norm if module is not None else fused_add_rms_norm_reference
    return kernel(x, residual, weight, eps)


def fused_norm_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    x_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, rms_norm(x, x_weight) + residual): Gemma's two norms between sublayers in one
    launch; the Triton version writes both in place of its inputs."""
    module = triton_module("norm", x)
    if module is None:
        return fused_norm_add_rms_norm_reference(x, residual, x_weight, weight, eps)
    return module.fused_norm_add_rms_norm(x, residual, x_weight, weight, eps)


def all_reduce_add_rms_norm(
    partial: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    peers: PeerBuffers,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, the ranks' partials summed + residual), with the sum over `peers`' group (no
    residual: the sum alone); the Triton version reduces in place of its inputs, on every rank
    at once."""
    module = triton_module("all_reduce_norm", partial)
    kernel = (
        module.all_reduce_add_rms_norm if module is not None else all_reduce_add_rms_norm_reference
    )
    return kernel(partial, residual, weight, eps, peers)


def all_gather(part: torch.Tensor, peers: PeerBuffers) -> torch.Tensor:
    """[M, world * P]: the ranks' parts [M, P] side by side in rank order, over `peers`'
    buffers; the Triton version on every rank at once."""
    module = triton_module("all_gather", part)
    return (module.all_gather if module is not None else all_gather_reference)(part, peers)


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, static_scale: torch.Tensor | None = None
) -> Fp8Rows:
    """RMSNorm feeding an FP8 layer: the normed rows quantized per token (or by the layer's
    static scale), in one pass."""
    module = triton_module("norm", x)
    kernel = module.rms_norm_fp8 if module is not None else rms_norm_fp8_reference
    return kernel(x, weight, eps, static_scale)


def fused_add_rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    static_scale: torch.Tensor | None = None,
) -> tuple[Fp8Rows, torch.Tensor]:
    """(normed x + residual quantized per token or by the static scale, x + residual) for an
    FP8 layer; the Triton version writes the sum in place of the residual."""
    module = triton_module("norm", x)
    kernel = (
        module.fused_add_rms_norm_fp8 if module is not None else fused_add_rms_norm_fp8_reference
    )
    return kernel(x, residual, weight, eps, static_scale)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    module = triton_module("activation", gate_up)
    return (module.silu_and_mul if module is not None else silu_and_mul_reference)(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma's MLP): gelu_tanh(gate) * up."""
    module = triton_module("activation", gate_up)
    kernel = module.gelu_tanh_and_mul if module is not None else gelu_tanh_and_mul_reference
    return kernel(gate_up)


def gelu_tanh_and_mul_fp8(
    gate_up: torch.Tensor, static_scale: torch.Tensor | None = None
) -> Fp8Rows:
    """GeGLU feeding an FP8 layer, as silu_and_mul_fp8."""
    module = triton_module("activation", gate_up)
    kernel = module.gelu_tanh_and_mul_fp8 if module is not None else gelu_tanh_and_mul_fp8_reference
    return kernel(gate_up, static_scale)


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    counts: torch.Tensor | None = None,  # [E] int64: each real token's choices added to it
    slots: torch.Tensor | None = None,  # [T]: the tokens' KV slots; < 0: padding, not counted
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] float32, expert ids [T, k]
    module = triton_module("moe_route", logits)
    run = module.moe_route if module is not None else moe_route_reference
    return run(logits, top_k, renormalize, counts, slots)


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up_scale: torch.Tensor | None = None,  # FP8 experts' (kernels/moe.py)
    down_scale: torch.Tensor | None = None,
    biases: ExpertBiases | None = None,  # gpt-oss's
    swiglu: ClampedSwiglu | None = None,  # gpt-oss's activation (None: silu(gate) * up)
    all_experts: int | None = None,  # with expert parallelism, every rank's (None: down's)
) -> torch.Tensor:
    """A token's choices of expert -1 (another rank's, with expert parallelism) add nothing.
    The kernels pick GEMVs or grouped GEMMs by the pairs against all_experts."""
    module = triton_module("moe", x)
    args = (x, gate_up, down, weights, ids, gate_up_scale, down_scale, biases, swiglu)
    if module is None:
        return moe_experts_reference(*args)
    return module.moe_experts(*args, all_experts=all_experts)


def moe_experts_int4(
    x: torch.Tensor,
    gate_up: Int4Stack,
    down: Int4Stack,
    weights: torch.Tensor,
    ids: torch.Tensor,
    biases: ExpertBiases | None = None,  # gpt-oss's
    swiglu: ClampedSwiglu | None = None,
    all_experts: int | None = None,  # with expert parallelism, every rank's (None: down's)
) -> torch.Tensor:
    """int4 or MXFP4 experts (W4A16, kernels/moe.py); as moe_experts, choices of -1 add nothing
    and the kernels are picked by the pairs against all_experts."""
    module = triton_module("moe_int4", x)
    if module is None:
        return moe_experts_int4_reference(x, gate_up, down, weights, ids, biases, swiglu)
    return module.moe_experts_int4(x, gate_up, down, weights, ids, biases, swiglu, all_experts)


def silu_and_mul_fp8(gate_up: torch.Tensor, static_scale: torch.Tensor | None = None) -> Fp8Rows:
    """SiLU-and-mul feeding an FP8 layer: the product quantized per token (or by the layer's
    static scale), in one pass."""
    module = triton_module("activation", gate_up)
    kernel = module.silu_and_mul_fp8 if module is not None else silu_and_mul_fp8_reference
    return kernel(gate_up, static_scale)


def gather_sampled_inputs(
    input_ids: torch.Tensor,  # [num_tokens] int32, updated in place
    source_rows: torch.Tensor,  # [num_tokens] int32: row of sampled_ids to take, or -1
    sampled_ids: torch.Tensor,  # [max_reqs] int64
) -> None:
    module = triton_module("inputs", input_ids)
    kernel = module.gather_sampled_inputs if module is not None else gather_sampled_inputs_reference
    kernel(input_ids, source_rows, sampled_ids)


def catch_up_rows(
    base: torch.Tensor, blocks: torch.Tensor, first_sample: torch.Tensor, drafts: torch.Tensor,
    sampled: torch.Tensor | None, positions: torch.Tensor,
    *outs: torch.Tensor,  # row_blocks, accepted, drafting, at, last
) -> None:  # fmt: skip
    """A speculative step's catch-up rows (`kernels.inputs.catch_up_rows_reference`)."""
    module = triton_module("inputs", base)
    kernel = module.catch_up_rows if module is not None else catch_up_rows_reference
    kernel(base, blocks, first_sample, drafts, sampled, positions, *outs)


def next_token_ids(
    input_ids: torch.Tensor, sample_rows: torch.Tensor, sampled: torch.Tensor | None,
    out: torch.Tensor, num_tokens: int,
) -> None:  # fmt: skip
    """The token after each position of a step (`kernels.inputs.next_token_ids_reference`)."""
    module = triton_module("inputs", out)
    kernel = module.next_token_ids if module is not None else next_token_ids_reference
    kernel(input_ids, sample_rows, sampled, out, num_tokens)


def draft_pass_inputs(
    last: torch.Tensor, step: int, drafting: torch.Tensor, row_blocks: torch.Tensor,
    block_tables: torch.Tensor, block_size: int, max_model_len: int,
    *outs: torch.Tensor,  # slot_mapping, seq_lens, rotary_positions: [R] int32
) -> None:  # fmt: skip
    """An EAGLE-3 draft pass's inputs (`kernels.inputs.draft_pass_inputs_reference`)."""
    module = triton_module("inputs", last)
    kernel = module.draft_pass_inputs if module is not None else draft_pass_inputs_reference
    kernel(last, step, drafting, row_blocks, block_tables, block_size, max_model_len, *outs)


def rotary_write_kv(
    positions: torch.Tensor,  # [num_tokens] int
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, 2, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; negative: padding, not written
    q_norm_weight: torch.Tensor | None = None,  # [head_dim], Qwen3's per-head q/k norm
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: float = 1.0,  # an FP8 cache's scales: it holds key / k_scale, value / v_scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """(q/k norm,) rotary, and the rotated key and the value into the cache; returns the query.

    One kernel on CUDA instead of two to four: at small batches launches are the cost. The
    Triton version rotates the query in place.
    """
    module = triton_module("rotary_cache", query)
    kernel = module.rotary_write_kv if module is not None else rotary_write_kv_reference
    return kernel(
        positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping,
        q_norm_weight, k_norm_weight, eps, k_scale, v_scale,
    )  # fmt: skip


def linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    lora: LoraDelta | None = None,  # what each row's LoRA adapter adds
) -> torch.Tensor:  # [M, N]
    """A linear layer; for decode-sized inputs on CUDA (`skinny_max_rows`: 64 rows on Hopper,
    16 elsewhere) the weight-streaming Triton GEMV, which adds the LoRA delta in its epilogue
    where it can; past that cuBLAS, then the LoRA expand."""
    module = triton_module("linear", x)
    if module is not None and 1 <= x.shape[0] <= module.skinny_max_rows(x):
        return module.skinny_linear(x, weight, bias, lora=lora)
    out = linear_reference(x, weight, bias)
    return out if lora is None else lora_expand(out, *lora)


def gated_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool
) -> torch.Tensor:
    """linear(act(gate) * up, weight, bias) for a gated MLP's gate_up [M, 2K] (act: gelu_tanh
    with `gelu`, else silu): up to GATED_MAX_ROWS rows on CUDA one launch of the skinny GEMV,
    which makes its input from gate_up as it streams the weight; else the two ops."""
    module = triton_module("linear", gate_up)
    if module is not None and 1 <= gate_up.shape[0] <= module.GATED_MAX_ROWS:
        return module.skinny_linear(gate_up, weight, bias, gated="gelu_tanh" if gelu else "silu")
    return linear((gelu_tanh_and_mul if gelu else silu_and_mul)(gate_up), weight, bias)


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, P, R, K]
    token_slots: torch.Tensor,  # [T] int32, -1: none
    token_order: torch.Tensor | None = None,  # [T] int32, the tokens grouped by slot
) -> torch.Tensor:  # [KS, T, P, R] float32, partial sums over KS parts of K
    """Each token's x times the A of the LoRA adapter in its slot (`kernels/lora.py`)."""
    module = triton_module("lora", x)
    kernel = module.lora_shrink if module is not None else lora_shrink_reference
    return kernel(x, lora_a, token_slots, token_order)


def lora_expand(
    out: torch.Tensor,  # [T, N], added to in place
    shrunk: torch.Tensor,  # [KS, T, P, R] float32, as lora_shrink makes it
    lora_b: torch.Tensor,  # [S, N, R]
    token_slots: torch.Tensor,  # [T] int32, -1: none
    piece_rows: tuple[int, ...],  # output rows of each piece, summing to N
    token_order: torch.Tensor | None = None,  # [T] int32, the tokens grouped by slot
) -> torch.Tensor:  # out
    """out += each token's shrunk times the B of the adapter in its slot (`kernels/lora.py`)."""
    module = triton_module("lora", out)
    kernel = module.lora_expand if module is not None else lora_expand_reference
    return kernel(out, shrunk, lora_b, token_slots, piece_rows, token_order)


def argmax(
    logits: torch.Tensor, offsets: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:  # [R] int64
    """The first index of each row's maximum of logits [R, V], plus offsets[index] where given
    (a draft vocabulary's map into the target's), into `out` where given ([R] int64)."""
    module = triton_module("argmax", logits)
    return (module.argmax if module is not None else argmax_reference)(logits, offsets, out)
