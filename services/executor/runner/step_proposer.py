"""Proposers that draft on the device right after each step of the target: speculative
decoding's `draft_model` (services/executor/runner/draft_proposer.py) and `eagle3`
(services/executor/runner/eagle_proposer.py). This is their common part.

Right after the step's sampling, on the device and before the host has seen the step's tokens,
`after_step` queues the proposer's work on the step's own layout (its positions, KV slots and
block tables: the step buffers the target read):

- the catch-up: the proposer's model at every position the step computed, writing its own KV
  cache (on the target's block ids, in the target's block shape). A verifying row's positions
  past the first draft the target rejected get KV that the next step writes over before
  anything reads it (the next step computes those positions again);
- the drafts, from each speculating row's drafting position: its last accepted one, found on
  the device by comparing the row's drafts with the step's samples, as the host will
  (step_state.accepted). Each draft is a pass of one token a row, its slots, context lengths and
  rotary positions made on the device (`ops.draft_pass_inputs`): no host in between.

On a GPU that is one CUDA graph per step shape of the target's, replayed after a few small
kernels that derive its inputs; the drafts then come to the host with one copy, which the next
step's layout waits for (`take_drafts`), the step's own tokens having come first. Between two
steps the host's only wait is that one.

So the proposer's KV follows the target's: every position the target computed has the
proposer's KV from the same step, prefix-cache hits and resumed requests included (their blocks
hold both), and it keeps nothing per request. (The host KV tier, which would bring back blocks
of the target's KV alone, is refused with these proposers.)
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kernels import ops
from services.executor.layers.attention_metadata import AttentionMetadata
from services.executor.runner.cuda_graphs import StepGraphs
from services.executor.runner.kv_cache import KVCacheLayout
from services.executor.runner.list_upload import ListUpload
from services.executor.runner.step_buffers import StepView
from services.executor.runner.step_state import PreparedStep
from services.executor.speculative import PendingDrafts, SpeculatingRequest
from shared.config import Config


@dataclass
class CatchUpInputs:
    """What the host knows at launch of a step's catch-up, by row of the step: the token index
    of its first sampled position (-1: it drafts nothing), that position's sample index, the
    drafts it verifies, its blocks; and the last position of each prompt chunk that stops short
    of its prompt's end, with the (known) token after it."""

    request_ids: list[str] = field(default_factory=list)
    base: list[int] = field(default_factory=list)
    first_sample: list[int] = field(default_factory=list)
    verified: list[list[int]] = field(default_factory=list)
    num_blocks: list[int] = field(default_factory=list)
    chunk_ends: list[int] = field(default_factory=list)
    chunk_next: list[int] = field(default_factory=list)

    @classmethod
    def of(
        cls, prepared: PreparedStep, requests: Mapping[str, SpeculatingRequest]
    ) -> CatchUpInputs:
        inputs, sample, samples = cls(), 0, prepared.sample_rows
        for span in prepared.spans:
            state = requests[span.request_id]
            end = span.first + span.count
            drafts: list[int] = []
            base = -1
            if sample < len(samples) and samples[sample] < end:  # it samples: its last positions
                drafts = prepared.drafts.get(sample, [])
                base = samples[sample] if state.speculates else -1
                inputs.first_sample.append(sample)
                sample += len(drafts) + 1
            else:  # a prompt chunk short of the prompt's end: the token after it is known
                inputs.first_sample.append(0)
                after = span.start + span.count
                if after >= len(state.token_ids):  # only a row that samples reaches the end
                    raise RuntimeError(f"{span.request_id}: token {after} after a row unknown")
                inputs.chunk_ends.append(end - 1)
                inputs.chunk_next.append(state.token_ids[after])
            inputs.request_ids.append(span.request_id)
            inputs.base.append(base)
            inputs.verified.append(drafts if base >= 0 else [])
            inputs.num_blocks.append(len(state.block_ids))
        return inputs


class StagedRows(NamedTuple):
    """What `_stage` puts on the device for a subclass's inputs, by row of the step."""

    first_sample: torch.Tensor  # [rows]: the row's first sample index
    accepted: torch.Tensor  # [rows]: the drafts it accepted (0 where it verified none)
    chunk_ends: torch.Tensor  # the last position of each prompt chunk short of its end
    chunk_next: torch.Tensor  # the token after it


class StepProposer(abc.ABC):
    """A proposer's buffers, staging, draft passes' inputs, graphs and hand-over of drafts;
    a subclass gives the work itself (`_catch_up_forward`)."""

    # How far a draft's pass sits past the position it drafts after, less one: draft i
    # (from 1) is computed at position last + i - 1 + WRITES_AHEAD, where last is the row's
    # drafting position. An EAGLE-3 head reads the token after its position (0); a draft
    # model reads the token at it, so its first draft needs a pass of its own (1).
    WRITES_AHEAD = 0
    NAME = ""  # for the log: what the proposer runs

    def __init__(
        self,
        config: Config,
        num_drafts: int,
        max_model_len: int,
        layout: KVCacheLayout,
        device: torch.device,
    ) -> None:
        self.num_drafts = num_drafts
        self.max_model_len = max_model_len
        self.layout = layout
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        # Fixed inputs and outputs of the passes (CUDA graphs read and write them), by row, as
        # ops.catch_up_rows writes them: its blocks, the drafts it accepted, whether it drafts,
        # its drafting position's token index (0 where none) and that position; then each
        # pass's drafts.
        rows, tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.row_blocks = torch.zeros(rows, dtype=torch.int64, device=device)
        self.accepted = torch.zeros(rows, dtype=torch.int64, device=device)
        self.drafting = torch.zeros(rows, dtype=torch.bool, device=device)
        self.at = torch.zeros(rows, dtype=torch.int64, device=device)
        self.last = torch.zeros(rows, dtype=torch.int64, device=device)
        self.ids = torch.zeros(num_drafts, rows, dtype=torch.int64, device=device)
        # query_start_loc of a draft pass: one token a row; its slots, context lengths and
        # rotary positions (ops.draft_pass_inputs)
        self.row_starts = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.pass_inputs = torch.zeros(3, rows, dtype=torch.int32, device=device).unbind(0)
        # The catch-up's host inputs: a step's rows, block counts, first samples, drafts and
        # prompt chunks' ends and next tokens.
        sizes = (rows, rows, rows, rows * num_drafts, tokens, tokens)
        self.upload = ListUpload(ListUpload.room(*sizes), device)
        self.catch_up_graphs: StepGraphs | None = None

    def allocate(self, num_blocks: int) -> None:
        """The proposer's KV cache, on the target's block ids."""
        self.kv_caches = self.layout.allocate(num_blocks, self.device)

    def finished(self, request_id: str, output_token_ids: list[int]) -> None:  # noqa: B027
        """Nothing is kept per request: the proposer's KV follows the target's steps."""

    def reset(self) -> None:  # noqa: B027 (as finished: nothing to forget)
        """As `finished`."""

    @torch.inference_mode()
    def after_step(
        self,
        prepared: PreparedStep,
        view: StepView,
        sampled: torch.Tensor | None,
        requests: Mapping[str, SpeculatingRequest],
    ) -> PendingDrafts | None:
        """Queue the catch-up and the drafts of a launched step (`view`: its buffers on the
        device, the target's input ids gathered; `sampled`: its samples [S], on the device)."""
        if not prepared.spans:
            return None
        inputs = CatchUpInputs.of(prepared, requests)
        num_rows = view.meta.seq_lens.shape[0]  # a graph's padding rows included
        self._stage(inputs, view, sampled, len(prepared.token_ids), num_rows)
        graphs, shape = self.catch_up_graphs, prepared.shape
        if graphs is not None and shape is not None:
            graphs.replay(shape)
        else:
            self._catch_up_forward(view)
        ids = self.ids[:, : len(inputs.request_ids)]
        on_cuda = self.device.type == "cuda"
        host = ids.to("cpu", non_blocking=True) if on_cuda else ids.clone()
        ready = None
        if on_cuda:
            ready = torch.cuda.Event()
            ready.record()
        drafting = [base >= 0 for base in inputs.base]
        return PendingDrafts(inputs.request_ids, drafting, inputs.num_blocks, host, ready)

    def take_drafts(
        self,
        proposal: PendingDrafts,
        wanted: set[str],
        requests: Mapping[str, SpeculatingRequest],
    ) -> dict[str, list[int]]:
        """The drafts of a collected step for the `wanted` requests (their tokens all known,
        none in flight): as many as their blocks at the step's launch had room for. Waits for
        the proposer's work only where a row is wanted."""
        rows = [
            (row, request_id)
            for row, request_id in enumerate(proposal.request_ids)
            if request_id in wanted and proposal.drafting[row]
        ]
        if not rows:
            return {}
        columns = proposal.columns()  # the one wait
        drafts = {}
        size = self.layout.block_size
        for row, request_id in rows:
            room = min(proposal.num_blocks[row] * size, self.max_model_len)
            # the token count is last + 2: draft i's pass at last + i - 1 + WRITES_AHEAD
            # needs a slot under room
            tokens = len(requests[request_id].token_ids)
            count = max(0, min(self.num_drafts, room - tokens + 2 - self.WRITES_AHEAD))
            if count:
                drafts[request_id] = [column[row] for column in columns[:count]]
        return drafts

    def _stage(
        self,
        inputs: CatchUpInputs,
        view: StepView,
        sampled: torch.Tensor | None,
        num_tokens: int,
        num_rows: int,
    ) -> None:
        """The catch-up's inputs on the device: each row's drafting position (its first sampled
        one + the drafts accepted) and blocks, and what the subclass reads (`_stage_tokens`)."""
        pad = [-1] * (num_rows - len(inputs.base))
        k = self.num_drafts
        padded = [drafts + [-1] * (k - len(drafts)) for drafts in inputs.verified]
        parts = self.upload.send(
            inputs.base + pad,
            inputs.num_blocks + [0] * len(pad),
            inputs.first_sample,
            [token for row in padded for token in row],
            inputs.chunk_ends,
            inputs.chunk_next,
        )
        base, blocks, first_sample, drafts, chunk_ends, chunk_next = parts
        rows = len(inputs.base)
        checked = sampled if any(inputs.verified) else None  # no drafts: no sample to check
        accepted = self.accepted[:rows]
        ops.catch_up_rows(
            base, blocks, first_sample, drafts.view(rows, k), checked, view.positions,
            self.row_blocks[:num_rows], accepted,
            self.drafting[:num_rows], self.at[:num_rows], self.last[:num_rows],
        )  # fmt: skip
        staged = StagedRows(first_sample, accepted, chunk_ends, chunk_next)
        self._stage_tokens(view, sampled, num_tokens, staged)

    def _draft_none(self) -> None:
        """No row drafts this step (as the capture of the graphs has it)."""
        self.drafting.zero_()
        self.at.zero_()
        self.last.zero_()

    @abc.abstractmethod
    def _stage_tokens(
        self, view: StepView, sampled: torch.Tensor | None, num_tokens: int, staged: StagedRows
    ) -> None:
        """The tokens the subclass's passes read, into its fixed buffers."""

    @abc.abstractmethod
    def _catch_up_forward(self, view: StepView) -> torch.Tensor:
        """The proposer at each position of the step, then its drafts into `ids`."""

    def _pass_meta(
        self, meta: AttentionMetadata, last: torch.Tensor, drafting: torch.Tensor, step: int
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """A draft pass at each row's `last` + `step` (one token a row): its attention
        metadata and rotary positions. A row's slot there comes from its block table where it
        drafts, has a block (row_blocks) and the position is under max_model_len; else it
        writes no KV and attends to a context of one token (a draft take_drafts drops)."""
        num = last.shape[0]
        tables = meta.block_tables[:num]
        slots, seq_lens, at = (buffer[:num] for buffer in self.pass_inputs)
        ops.draft_pass_inputs(
            last, step, drafting, self.row_blocks[:num], tables, self.layout.block_size,
            self.max_model_len, slots, seq_lens, at,
        )  # fmt: skip
        pass_meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=seq_lens,
            query_start_loc=self.row_starts[: num + 1],
            max_query_len=1,
            max_seq_len=min(meta.max_seq_len + step, self.max_model_len),
        )
        return pass_meta, at

    def _drafting_rows(self, view: StepView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Of each row of the step (padding included): whether it drafts, the token index of
        its drafting position and that position (0 where it does not draft), as `_stage`
        made them."""
        num_rows = view.meta.seq_lens.shape[0]
        return self.drafting[:num_rows], self.at[:num_rows], self.last[:num_rows]

    def capture_graphs(self, target_graphs: StepGraphs) -> None:
        """CUDA graphs of the catch-up and the draft passes after it, one for each of the
        target's (the same step buffers, the same shapes): a pass of small kernels, whose
        launches from Python would cost more than the GPU's work."""
        self._draft_none()  # the captures draft nothing and write no draft KV
        self.row_blocks.zero_()
        graphs = StepGraphs(
            self._catch_up_forward,
            target_graphs.buffers,
            target_graphs.max_reqs,
            target_graphs.max_seq_len,
            mixed=bool(target_graphs.mixed_sizes),
            name=self.NAME,
        )
        with torch.inference_mode():
            graphs.capture()
        self.catch_up_graphs = graphs
