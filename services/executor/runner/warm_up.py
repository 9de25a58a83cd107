"""Warm-up steps at start, so that the first requests do not pay for first-use compiles.

Triton compiles a kernel variant the first time it meets new constants (a token count that is
or is not a multiple of 16, another tile size); cuBLAS picks algorithms per shape; the sampler
has a greedy, a random and a logprob path. On a fresh machine that cost 0.2-0.5 s, paid by
the first request. These steps meet them before the server says it is ready: a mixed step
(graph), decode steps (graphs), and eager steps of more tokens than the largest mixed graph,
one of an odd token count and one of a multiple of 16; then the decode attention kernel with
and without a mixed batch (a variant met mid-burst stalled a server for its compile); past 256
requests (--max-num-seqs), an eager step of each power of two of requests, which the prefill
kernel compiles apart; the lm_head at the skinny GEMV's larger row tiles (it runs on a
step's sampled rows, outside the graphs), and without CUDA graphs (whose capture meets them)
the other linear layers too. (Rarer variants still compile on first use: eager steps of more
than 256 requests whose longest query is short.)
They use blocks from 0 up, and each step of many requests uses them again from 0 (every
request before it has finished); nothing is registered in the prefix cache, so real requests
never read what they wrote. Limits too small for these steps skip them, with a log line; a KV
cache too small for a step of many requests skips that step alone.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Protocol

import torch

from kernels import ops
from kernels.attention import PREFILL_REQS_MIN_POW2
from services.executor.layers.linear import Linear
from services.executor.layers.mlp import GatedMLP
from services.executor.layers.moe import SparseMoE
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.runner.cuda_graphs import MIXED_GRAPH_MAX_TOKENS, StepGraphs
from services.executor.runner.grammar import GrammarMatchers
from services.executor.runner.step_buffers import StepBuffers
from services.executor.runner.step_proposer import StepProposer
from shared.model_config import ModelConfig
from shared.protocol import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)

_FIRST_STEP = {  # request id -> (prompt length, sampling): every sampler path at once
    "warm-greedy": (37, SamplingParams(temperature=0.0, max_tokens=8)),
    "warm-random": (150, SamplingParams(temperature=0.8, top_p=0.9, top_k=40, logprobs=2)),
    "warm-penalty": (5, SamplingParams(temperature=0.0, repetition_penalty=1.1)),
}
_FIRST_STEP_TOKENS = sum(n for n, _ in _FIRST_STEP.values())
_NUM_DECODES = 3
# Rows in the GEMVs' row tiles whose kernels the decode steps here (3 rows) do not meet: the
# FP8 GEMV's 16-row tile (kernels/triton_fp8.py: 9-16; 1-8 take 8), and both GEMVs' 32- and
# 64-row tiles (17-32, 33-64).
_LINEAR_ROWS = (12, 24, 48)
# A prompt in the steps of more than 256 requests: the prefill kernel's large tiles (any GQA
# group), and with the one-token prompts more tokens than the largest mixed graph.
_LONG_PROMPT = MIXED_GRAPH_MAX_TOKENS


class WarmUpTarget(Protocol):
    """What the warm-up reads of the model runner (runner/model_runner.py), which runs it."""

    block_size: int
    buffers: StepBuffers
    device: torch.device
    dtype: torch.dtype
    grammars: GrammarMatchers
    graphs: StepGraphs | None
    kv_caches: list[torch.Tensor]
    max_model_len: int
    max_num_batched_tokens: int
    model: DecoderForCausalLM
    model_config: ModelConfig
    num_blocks: int
    proposer: object  # a speculative decoding proposer, or None

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput: ...


class _Plans:
    """Hands out blocks and step numbers for the warm-up plans."""

    def __init__(self, runner: WarmUpTarget) -> None:
        self.runner = runner
        self.vocab_size = runner.model_config.vocab_size
        self.next_block = 0
        self.step = -1000  # apart from the engine's own steps, which start at 0

    def run(
        self,
        scheduled: dict[str, int],
        new: list[NewRequestData] | None = None,
        cached: list[CachedRequestData] | None = None,
        finished: list[str] | None = None,
    ) -> None:
        self.step += 1
        plan = SchedulerOutput(
            step=self.step,
            new_requests=new or [],
            cached_requests=cached or [],
            num_scheduled_tokens=scheduled,
            finished_request_ids=finished or [],
        )
        self.runner.execute(plan)

    def reuse_blocks(self) -> None:
        """Hand out blocks from 0 again: for a plan run after every earlier request finished."""
        self.next_block = 0

    def new(self, request_id: str, prompt_len: int, params: SamplingParams) -> NewRequestData:
        num_blocks = _blocks(self.runner, [prompt_len])  # each group's in turn (step_state.py)
        blocks = list(range(self.next_block, self.next_block + num_blocks))
        self.next_block += num_blocks
        return NewRequestData(
            request_id=request_id,
            prompt_token_ids=[(7 * i) % self.vocab_size for i in range(prompt_len)],
            output_token_ids=[],
            sampling_params=params,
            block_ids=blocks,
            num_computed_tokens=0,
        )


def eager_lengths(runner: WarmUpTarget) -> list[int]:
    """Token counts past the largest mixed graph that fit a step: odd, then a multiple of 16."""
    limit = min(runner.max_num_batched_tokens, runner.max_model_len - _NUM_DECODES - 1)
    lengths = [MIXED_GRAPH_MAX_TOKENS + 19, (limit // 16) * 16]
    return [n for n in lengths if MIXED_GRAPH_MAX_TOKENS < n <= limit]


def _many_request_counts(runner: WarmUpTarget) -> list[int]:
    """Past 256 requests (--max-num-seqs) each power of two of requests in an eager mixed step
    is a compile of the prefill kernel of its own (`reqs_pow2`): a step of one more request
    than each lower power of two meets it, if its requests and long prompt fit the budget."""
    limit = min(runner.buffers.max_reqs, runner.max_num_batched_tokens - _LONG_PROMPT + 1)
    counts, power = [], 2 * PREFILL_REQS_MIN_POW2
    while power // 2 < limit:
        counts.append(power // 2 + 1)
        power *= 2
    fits = runner.max_model_len - _NUM_DECODES - 1 >= _LONG_PROMPT
    return counts if fits else []


def _many_request_lengths(num_reqs: int) -> list[int]:
    return [1] * (num_reqs - 1) + [_LONG_PROMPT]  # what _run_many_requests plans


def many_request_steps(runner: WarmUpTarget) -> list[int]:
    """The steps of many requests to run: those whose blocks fit the KV cache on their own."""
    return [
        num_reqs
        for num_reqs in _many_request_counts(runner)
        if _blocks(runner, _many_request_lengths(num_reqs)) <= runner.num_blocks
    ]


def _run_many_requests(plans: _Plans, num_reqs: int) -> list[str]:
    """One eager mixed step: num_reqs - 1 one-token prompts, as decodes ride along, beside
    a prompt long enough for the kernel's large tiles and for more tokens than any mixed
    graph takes."""
    greedy = SamplingParams(temperature=0.0)
    *short, long = _many_request_lengths(num_reqs)
    requests = [plans.new(f"warm-many-{i}", n, greedy) for i, n in enumerate(short)]
    requests.append(plans.new("warm-many-long", long, greedy))
    scheduled = {r.request_id: len(r.prompt_token_ids) for r in requests}
    plans.run(scheduled, new=requests)
    return list(scheduled)


def first_step_lengths(runner: WarmUpTarget) -> list[int]:
    """The first step's prompt lengths, scaled down to fit the token budget and the context."""
    scale = min(1.0, runner.max_num_batched_tokens / _FIRST_STEP_TOKENS)
    longest = runner.max_model_len - _NUM_DECODES - 1
    return [max(1, min(int(n * scale), longest)) for n, _ in _FIRST_STEP.values()]


def _blocks(runner: WarmUpTarget, prompt_lengths: list[int]) -> int:
    """The blocks that warm-up requests of these prompt lengths take (_Plans.new): with layer
    groups, each group's blocks for every token (the warm-up's steps are short, and a sliding
    group's window no smaller than a step's tokens would free none of them)."""
    per_group = sum(-(-(n + _NUM_DECODES + 1) // runner.block_size) for n in prompt_lengths)
    return per_group * runner.buffers.num_groups


def blocks_needed(runner: WarmUpTarget) -> int:
    """The blocks of the first step's requests and the eager steps', held together (the steps
    of many requests reuse them: many_request_steps)."""
    return _blocks(runner, first_step_lengths(runner) + eager_lengths(runner))


def skip_reason(runner: WarmUpTarget) -> str | None:
    """Why the warm-up steps do not fit this runner's limits, if they do not."""
    if runner.model.layout.tp.replicas is not None:  # the replicas' would have to be alike
        return "expert parallelism across replicas: each step takes a round with the others"
    if runner.buffers.max_reqs < len(_FIRST_STEP):
        return f"--max-num-seqs below {len(_FIRST_STEP)}"
    if runner.max_model_len < _NUM_DECODES + 2:
        return "--max-model-len too short"
    if sum(first_step_lengths(runner)) > runner.max_num_batched_tokens:
        return "--max-num-batched-tokens too small"
    if blocks_needed(runner) > runner.num_blocks:
        return "the KV cache is smaller than its steps need"
    return None


def _compile_attention_variants(runner: WarmUpTarget) -> None:
    """The decode attention kernel in a decode and in a mixed batch, with one split and with
    several: an eager step's split count follows its batch."""
    cfg = runner.model.layout.local_config
    key_cache, value_cache = runner.kv_caches[0][0], runner.kv_caches[0][1]
    query = torch.zeros(1, cfg.num_heads, cfg.head_dim, dtype=runner.dtype, device=runner.device)
    windows = {None if cfg.sliding_window is None or i not in cfg.sliding_layers
               else cfg.sliding_window for i in range(cfg.num_layers)}  # fmt: skip
    ops.compile_attention_variants(
        query, key_cache, value_cache, runner.buffers.decode_queries, tuple(windows),
        cfg.attn_logit_softcapping,
    )  # fmt: skip


def _compile_linear_variants(runner: WarmUpTarget) -> None:
    """The lm_head at _LINEAR_ROWS, and without CUDA graphs the first layer's projections and
    gated MLPs too (whose down projection's GEMV makes its input from gate_up): every layer
    has their shapes, so the eager decode steps of those batches compile nothing. (Graph
    capture runs every decode batch size through the layers, not the lm_head, which runs
    eagerly on the rows a step samples: its batch, or with speculative decoding each row's
    drafts and the token after them.)"""
    model = runner.model
    linears: list[Linear | GatedMLP] = [model.lm_head]
    if runner.graphs is None:
        modules = list(model.layers[0].modules())
        linears += [m for m in modules if isinstance(m, Linear | GatedMLP)]
    with torch.inference_mode():
        for rows, module in itertools.product(_LINEAR_ROWS, linears):
            layer = module if isinstance(module, Linear) else module.gate_up_proj
            width = layer.in_features
            module(torch.zeros(rows, width, dtype=runner.dtype, device=runner.device))
        if runner.graphs is None:
            _compile_expert_gemvs(runner)


def _compile_expert_gemvs(runner: WarmUpTarget) -> None:
    """The first mixture of experts at one token: the decode steps here (3 rows) take the
    grouped GEMMs where the expert GEMVs stop short of 3 tokens (FP8 experts: up to experts / 8
    pairs, kernels/triton_moe.py `uses_gemv`), so an eager batch of 1 or 2 would compile the
    GEMVs mid-serve. Its row is padding (slot -1): no expert load is counted. Not with experts
    across replicas, whose layers gather every replica's rows (a collective)."""
    moe = next((m for m in runner.model.modules() if isinstance(m, SparseMoE)), None)
    if moe is None or moe.replicas is not None:
        return
    x = torch.zeros(1, moe.gate.in_features, dtype=runner.dtype, device=runner.device)
    moe(x, torch.full((1,), -1, dtype=torch.int64, device=runner.device))


def warm_up(runner: WarmUpTarget) -> None:
    _compile_attention_variants(runner)  # needs one cache block alone
    _compile_linear_variants(runner)
    # A draft model's or EAGLE-3 head's graphs, one for each of the target's; the warm-up
    # steps below run its work after each of theirs (eagerly without graphs; where they are
    # skipped, the first requests meet its kernels).
    if isinstance(runner.proposer, StepProposer) and runner.graphs is not None:
        runner.proposer.capture_graphs(runner.graphs)
    reason = skip_reason(runner)
    if reason is not None:
        logger.info("warm-up skipped (%s): the first requests may pay for compiles", reason)
        return
    start = time.perf_counter()
    plans = _Plans(runner)
    first = [
        plans.new(rid, n, params)
        for (rid, (_, params)), n in zip(
            _FIRST_STEP.items(), first_step_lengths(runner), strict=True
        )
    ]
    plans.run({r.request_id: len(r.prompt_token_ids) for r in first}, new=first)
    for i in range(1, _NUM_DECODES + 1):
        plans.run(
            {r.request_id: 1 for r in first},
            cached=[
                CachedRequestData(
                    request_id=r.request_id,
                    new_block_ids=[],
                    num_computed_tokens=len(r.prompt_token_ids) + i - 1,
                )
                for r in first
            ],
        )
    finished = [r.request_id for r in first]
    for index, length in enumerate(eager_lengths(runner)):
        request = plans.new(f"warm-eager-{index}", length, SamplingParams(temperature=0.0))
        plans.run({request.request_id: length}, new=[request], finished=finished)
        finished = [request.request_id]
    many = many_request_steps(runner)
    too_many = [n for n in _many_request_counts(runner) if n not in many]
    if too_many:
        logger.info("warm-up: no step of %s requests (the KV cache is too small for it)", too_many)
    for num_reqs in many:
        plans.run({}, finished=finished)  # rows free first: the step may take all of them
        plans.reuse_blocks()
        finished = _run_many_requests(plans, num_reqs)
    plans.run({}, finished=finished)
    logger.info("warm-up steps ran in %.1f s", time.perf_counter() - start)
    try:  # the grammar tokenizer, which the first structured-output request would wait for
        _ = runner.grammars.tokenizer
    except ValueError as exc:
        logger.info("structured output is off: %s", exc)
