"""Speculative decoding's `draft_model` method: a smaller model of the same tokenizer guesses each
request's next tokens, greedily, one forward pass a draft.

The draft has a KV cache of its own, in the target's block shape and on the same block ids:
a request's block-table row serves both models, and the scheduler's accounting covers both (it
sizes the pool for their bytes together, and reserves the slots past a request's tokens that
the next proposal writes: SchedulerConfig.num_lookahead_tokens). Per request the proposer
remembers the tokens whose draft KV it wrote; a proposal first feeds the ones since (the
accepted drafts are already there, the rest were rejected and are written over), in chunks of
at most `max_tokens`, then one token a forward pass for each further draft. A request new to
it (or resumed after a preemption, whose blocks changed) is fed from its first token: the
blocks a prefix-cache hit shares hold the target's KV, not necessarily the draft's.

It runs on the first rank only, whole (draft_tensor_parallel_size 1). Where the target runs
CUDA graphs the draft's passes replay graphs of their own (`capture_graphs`): one token a row
(each draft after the first), up to 1 + k a row (a catch-up after a verifying step: 1 or 2
tokens), and mixed steps (a new request's prompt, in chunks); larger passes run eagerly. Eager
passes of a 30-layer draft cost its kernels' launches, some 20 ms a pass on an H100
(SmolLM2-135M drafting for itself: 49 output tokens a second at batch 1, 2026-12-05).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping
from typing import Protocol

import torch

from services.executor.loading.loader import load_model
from services.executor.runner.cuda_graphs import StepGraphs
from services.executor.runner.kv_cache import KVCacheLayout
from services.executor.runner.step_buffers import StepBuffers, StepView
from shared.config import Config
from shared.model_config import ModelConfig, load_model_config, resolve_model_source
from shared.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


class HasBlocks(Protocol):
    block_ids: list[int]  # the request's blocks: the target's block-table row


class DraftProposer:
    def __init__(
        self,
        config: Config,
        spec: SpeculativeConfig,
        target: ModelConfig,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        source = resolve_model_source(spec.draft_model)
        self.model_config = load_model_config(source)
        if self.model_config.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({self.model_config.vocab_size} tokens) is not "
                f"the target's ({target.vocab_size}): it must share the target's tokenizer"
            )
        self.num_drafts = spec.num_speculative_tokens
        self.max_model_len = max_model_len
        self.model = load_model(
            source,
            self.model_config,
            config.load_format,
            dtype,
            device,
            max_position=max_model_len,
            seed=config.seed,
            quantization=spec.draft_quantization,
        )
        self.layout = KVCacheLayout.of(self.model_config, config.block_size, dtype)
        self.buffers = StepBuffers(
            config.max_num_batched_tokens,
            config.max_num_seqs,
            -(-max_model_len // config.block_size),
            config.block_size,
            device,
            decode_queries=1 + self.num_drafts,  # a row feeds up to the tokens verified
        )
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: StepGraphs | None = None
        self.requests: Mapping[str, HasBlocks] = {}
        # Per request, as of its last proposal: its first block, its token list (the
        # executor's, which only grows) and length then, and the drafts fed after them: the
        # draft KV written. Another first block or list: its KV is elsewhere, fed afresh.
        self.fed: dict[str, tuple[int, list[int], int, list[int]]] = {}
        logger.info(
            "draft model %s: %d layers, %d drafts a step",
            source.name,
            self.model_config.num_layers,
            self.num_drafts,
        )

    def allocate(self, num_blocks: int, requests: Mapping[str, HasBlocks]) -> None:
        """The draft's KV cache, on the target's block ids, which `requests` (the runner's,
        by id) hold."""
        self.kv_caches = self.layout.allocate(num_blocks, self.device)
        self.requests = requests

    def capture_graphs(self, max_batch: int, max_seq_len: int) -> None:
        """CUDA graphs of the draft's passes, at the target's bounds (after `allocate`)."""
        graphs = StepGraphs(
            self._forward, self.buffers, max_batch, max_seq_len, name="the draft model"
        )
        with torch.inference_mode():
            graphs.capture()
        self.graphs = graphs

    def _forward(self, view: StepView) -> torch.Tensor:
        return self.model(view.input_ids, view.positions, self.kv_caches, view.meta)

    def finished(self, request_id: str, output_token_ids: list[int]) -> None:
        """The request ended or was preempted: its blocks (and the draft KV in them) are gone."""
        self.fed.pop(request_id, None)

    def reset(self) -> None:
        self.fed.clear()

    @torch.inference_mode()
    def propose_batch(self, requests: Iterable[tuple[str, list[int]]]) -> dict[str, list[int]]:
        """Drafts for each (request id, its tokens), as many as its blocks hold the KV of."""
        rows = []
        for request_id, tokens in dict(requests).items():
            blocks = self.requests[request_id].block_ids
            room = min(len(blocks) * self.layout.block_size, self.max_model_len)
            num = min(self.num_drafts, room - len(tokens) + 1)
            if num < 1 or not tokens:
                continue
            done = self._fed_tokens(request_id, tokens, blocks[0])
            rows.append(_Row(request_id, tokens, blocks, min(done, len(tokens) - 1), num))
        self._catch_up(rows)
        for _ in range(1, self.num_drafts):
            going = [row for row in rows if len(row.drafts) < row.num]
            if not going:
                break
            self._run(going, [[row.drafts[-1]] for row in going])
        for row in rows:
            fed = (row.blocks[0], row.tokens, len(row.tokens), row.drafts[:-1])
            self.fed[row.request_id] = fed
        return {row.request_id: row.drafts for row in rows}

    def _fed_tokens(self, request_id: str, tokens: list[int], first_block: int) -> int:
        """How many leading `tokens` have their draft KV written: those of the last proposal,
        and its drafts up to the first the request's tokens since disagree with."""
        block, fed_list, length, drafts = self.fed.get(request_id, (-1, [], 0, []))
        if block != first_block or fed_list is not tokens or len(tokens) < length:
            return 0
        return length + _common_prefix(drafts, tokens[length : length + len(drafts)])

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Meet the draft's kernels before the first request: catch-ups whose longest row
        falls in each of the prefill kernel's row tiles (a power of two: 8, 16, 32, 64 tokens)
        and is odd or a multiple of 16, then one-token passes of 1 to 64 rows (the skinny
        GEMV's row tiles) and past them; with graphs (which met those shapes when captured),
        the one pass they leave eager: a catch-up longer than the largest mixed graph. Every
        row uses blocks from 0 up, which no request holds yet."""
        k = self.num_drafts
        warmed: tuple[int, list[int]] | None = None
        lengths = [7, 13, 25, 37, 48]
        if self.graphs is not None and self.graphs.mixed_sizes:
            lengths.append(self.graphs.mixed_sizes[-1] + 1)
        for length in lengths:
            count = -(-(length + k) // self.layout.block_size)
            blocks = list(range(min(count, self.kv_caches[0].shape[1])))
            if count > len(blocks) or length > min(self.buffers.max_tokens, self.max_model_len - k):
                continue
            self._run([_Row("warm", [1] * length, blocks, 0, k)], [[1] * length])
            warmed = (length, blocks)
        if warmed is None:
            return
        length, blocks = warmed
        for num_rows in (1, 3, 12, 24, 48, 80):
            if num_rows <= self.buffers.max_reqs:
                rows = [_Row("warm", [1] * length, blocks, length, k) for _ in range(num_rows)]
                self._run(rows, [[1]] * num_rows)

    def _catch_up(self, rows: list[_Row]) -> None:
        """Feed each row its tokens since the draft KV it has, `max_tokens` a pass at most;
        the pass that feeds a row's last token gives its first draft."""
        budget = self.buffers.max_tokens
        waiting = [row for row in rows if row.done < len(row.tokens)]
        while waiting:
            batch, chunks, left = [], [], budget
            for row in waiting:
                if left == 0 or len(batch) == self.buffers.max_reqs:
                    break
                chunk = row.tokens[row.done : row.done + left]
                batch.append(row)
                chunks.append(chunk)
                left -= len(chunk)
            self._run(batch, chunks)
            waiting = [row for row in waiting if row.done < len(row.tokens)]

    def _run(self, rows: list[_Row], chunks: list[list[int]]) -> None:
        """One forward pass: each row computes its chunk (from position row.done); a row
        whose chunk reaches past its tokens gets the greedy token after it as a draft."""
        self.buffers.wait_for_copy()
        for index, row in enumerate(rows):
            self.buffers.set_table_row(index, row.blocks)
        counts = [len(chunk) for chunk in chunks]
        ends = [end - 1 for end in itertools.accumulate(counts)]
        graphs = self.graphs
        shape = graphs.shape_for(len(rows), ends[-1] + 1, max(counts)) if graphs else None
        self.buffers.write(
            [t for chunk in chunks for t in chunk], [row.done for row in rows], counts, ends, shape
        )
        self.buffers.copy_to_device()
        if graphs is None or shape is None:
            hidden = self._forward(view := self.buffers.view())
        else:
            hidden = graphs.replay(shape)
            view = self.buffers.view()
        next_ids = self.model.compute_logits(hidden[view.sample_rows]).argmax(dim=-1).tolist()
        for row, count, token_id in zip(rows, counts, next_ids, strict=True):
            row.done += count
            if row.done >= len(row.tokens):
                row.drafts.append(token_id)


class _Row:
    """A request being proposed for: its tokens, blocks, how far the draft has fed it (its
    tokens, then its drafts), and how many drafts it may have."""

    def __init__(
        self, request_id: str, tokens: list[int], blocks: list[int], done: int, num: int
    ) -> None:
        self.request_id, self.tokens, self.blocks = request_id, tokens, blocks
        self.done, self.num = done, num
        self.drafts: list[int] = []


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
