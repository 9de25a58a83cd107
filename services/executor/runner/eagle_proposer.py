"""Speculative decoding's `eagle3` method: an EAGLE-3 head (services/executor/models/eagle3.py)
guesses each request's next tokens from the target's hidden states.

Every step of the target writes the residual streams entering three of its layers into one
buffer. Right after the step's sampling, on the device and before the host has seen the step's
tokens, `after_step` queues the head's work on the step's own layout (its positions, KV slots and
block tables, the step buffers the target read):

- the catch-up: at every position the step computed, the head reads its `fc` of the target's
  states there and the token after the position (the next input token of the row, or where the
  position was sampled, the sampled token), and writes its own KV cache (one layer, on the
  target's block ids, like a draft model's). A verifying row's positions past the first draft
  the target rejected get tokens that are no one's; their KV is written over before anything
  reads it (the next step computes those positions again);
- the first draft, at each speculating row's last accepted position, found on the device by
  comparing the row's drafts with the step's samples, as the host will (step_state.accepted);
- each further draft, one more pass at the next position, reading the draft before it and the
  head's own stream (EAGLE's stand-in for the target's state there).

On a GPU that is one CUDA graph per step shape, replayed after a few small kernels that derive
its inputs; the drafts then come to the host with one copy, which the next step's layout waits
for (`take_drafts`), the step's own tokens having come first. Between two steps the host's only
wait is that one; queueing the head's work (a loop over the step's rows, one upload, a dozen
small kernels and a replay) runs beside the target's step on the device.

So the head's KV follows the target's: every position the target computed has the head's KV
from the same step, prefix-cache hits and resumed requests included (their blocks hold both). A
shared prefix block's last position read the next token of the request that computed it;
another request's next token may differ, which costs acceptance, not exactness.

It runs whole on the first rank (with tensor parallelism, beside the target's part there: the
target's hidden states are whole on every rank, and the head reads a whole copy of the
target's embedding, gathered from the ranks at load).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kernels import ops
from services.executor.layers.attention_metadata import AttentionMetadata
from services.executor.loading.loader import load_eagle3_head
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.runner.cuda_graphs import StepGraphs
from services.executor.runner.kv_cache import KVCacheLayout
from services.executor.runner.step_buffers import StepView
from services.executor.runner.step_state import PreparedStep
from services.executor.speculative import PendingDrafts, SpeculatingRequest
from shared.config import Config
from shared.model_config import resolve_model_source
from shared.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


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


class EagleProposer:
    def __init__(
        self,
        config: Config,
        spec: SpeculativeConfig,
        target: DecoderForCausalLM,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        target_embedding: torch.nn.Module | None = None,
    ) -> None:
        """`target_embedding`: the target's embedding whole, where the target holds one
        rank's rows of it (tensor parallelism); None: the target's own."""
        source = resolve_model_source(spec.draft_model)
        self.head = load_eagle3_head(
            source, target, config.load_format, dtype, max_model_len, config.seed, target_embedding
        )
        # Before the KV cache is sized and graphs are captured: both must see the buffer.
        self.aux_hidden = target.capture_aux_hidden(
            self.head.config.aux_layer_ids, config.max_num_batched_tokens
        )
        self.num_drafts = spec.num_speculative_tokens
        self.max_model_len = max_model_len
        self.layout = KVCacheLayout.of(self.head.config.layer, config.block_size, dtype)
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        # Fixed inputs and outputs of the passes (CUDA graphs read and write them): the token
        # after each position; each row's drafting position (-1: none) and blocks; each
        # pass's drafts and streams, by row.
        hidden = self.head.config.layer.hidden_size
        rows, tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.next_ids = torch.zeros(tokens, dtype=torch.int32, device=device)
        self.draft_at = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.row_blocks = torch.zeros(rows, dtype=torch.int64, device=device)
        self.ids = torch.zeros(self.num_drafts, rows, dtype=torch.int64, device=device)
        self.streams = torch.zeros(self.num_drafts, rows, hidden, dtype=dtype, device=device)
        self.columns = torch.arange(self.num_drafts, device=device)
        # query_start_loc of a draft pass: one token a row; its slots, context lengths and
        # rotary positions (ops.draft_pass_inputs)
        self.row_starts = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.pass_inputs = torch.zeros(3, rows, dtype=torch.int32, device=device).unbind(0)
        # The catch-up's host inputs go up in one copy from pinned memory (_upload), from
        # two mirrors in turn: a copy is queued after its step's forward pass, and the next
        # step's is written while that may still run.
        pin = device.type == "cuda"
        size = rows * (3 + self.num_drafts) + 2 * tokens
        self.upload_host = [torch.zeros(size, dtype=torch.int64, pin_memory=pin) for _ in "ab"]
        self.upload_device = self.upload_host[0].to(device) if pin else self.upload_host[0]
        self._uploaded: list[torch.cuda.Event | None] = [None, None]
        self._uploads = 0
        self.catch_up_graphs: StepGraphs | None = None

    def allocate(self, num_blocks: int, requests: object = None) -> None:
        """The head's KV cache (one layer), on the target's block ids."""
        self.kv_caches = self.layout.allocate(num_blocks, self.device)

    def finished(self, request_id: str, output_token_ids: list[int]) -> None:
        """Nothing is kept per request: the head's KV follows the target's steps."""

    def reset(self) -> None:
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
        the head's work only where a row is wanted."""
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
            count = max(0, min(self.num_drafts, room - len(requests[request_id].token_ids) + 2))
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
        """The catch-up's inputs on the device: the token after each position, and each row's
        drafting position (its first sampled one + the drafts accepted) and blocks."""
        pad = [-1] * (num_rows - len(inputs.base))
        k = self.num_drafts
        verified = [drafts + [-1] * (k - len(drafts)) for drafts in inputs.verified]
        parts = self._upload(
            inputs.base + pad,
            inputs.num_blocks + [0] * len(pad),
            inputs.first_sample,
            [token for row in verified for token in row],
            inputs.chunk_ends,
            inputs.chunk_next,
        )
        base, blocks, first_sample, drafts, chunk_ends, chunk_next = parts
        next_ids = self.next_ids
        next_ids[: num_tokens - 1].copy_(view.input_ids[1:num_tokens])
        if sampled is not None:
            next_ids[view.sample_rows.long()] = sampled.to(next_ids.dtype)
        if inputs.chunk_ends:
            next_ids[chunk_ends] = chunk_next.to(next_ids.dtype)
        self.row_blocks[:num_rows].copy_(blocks)
        if sampled is None or not any(inputs.verified):
            self.draft_at[:num_rows].copy_(base)
            return
        # Each verifying row's accepted drafts: those equal to the samples before them.
        rows = len(inputs.base)
        at = (first_sample[:, None] + self.columns).clamp(max=sampled.shape[0] - 1)
        equal = sampled[at] == drafts.view(rows, k)  # a -1 (no draft) equals no sample
        accepted = equal.cumprod(dim=1).sum(dim=1)
        self.draft_at[:rows] = torch.where(base[:rows] >= 0, base[:rows] + accepted, -1)
        self.draft_at[rows:num_rows] = -1

    def _upload(self, *lists: list[int]) -> list[torch.Tensor]:
        """The lists on the device, in one copy from pinned memory."""
        mirror = self._uploads % 2
        self._uploads += 1
        copied = self._uploaded[mirror]
        if copied is not None:  # two steps ago: collected, so long done
            copied.synchronize()
        sizes = [len(values) for values in lists]
        total = sum(sizes)
        host = self.upload_host[mirror][:total]
        host.copy_(torch.tensor([v for values in lists for v in values], dtype=torch.int64))
        device = self.upload_device[:total]
        if device.device.type == "cuda":
            device.copy_(host, non_blocking=True)
            self._uploaded[mirror] = torch.cuda.Event()
            self._uploaded[mirror].record()
            return list(device.split(sizes))
        return list(host.split(sizes))

    def _catch_up_forward(self, view: StepView) -> torch.Tensor:
        """The head at each position of the step, then its drafts: at each row's drafting
        position (draft_at; -1: none) the first, and each further one from a pass of its own,
        into ids and streams. Returns the streams of the positions [T, hidden]."""
        num_tokens, num_rows = view.input_ids.shape[0], view.meta.seq_lens.shape[0]
        hidden = self.head.project(self.aux_hidden[:num_tokens])
        normed, stream = self.head(
            self.next_ids[:num_tokens], view.positions, hidden, self.kv_caches[0], view.meta
        )
        drafting = self.draft_at[:num_rows] >= 0
        at = self.draft_at[:num_rows].clamp(min=0)
        self.ids[0, :num_rows] = self.head.draft_ids(torch.index_select(normed, 0, at))
        torch.index_select(stream, 0, at, out=self.streams[0, :num_rows])
        last = torch.index_select(view.positions, 0, at)
        for j in range(1, self.num_drafts):
            self._draft_pass(view.meta, last, drafting, j)
        return stream

    def _draft_pass(
        self, meta: AttentionMetadata, last: torch.Tensor, drafting: torch.Tensor, j: int
    ) -> None:
        """Draft j + 1 of each drafting row, at its drafting position `last` + j: the head
        reads draft j and its own stream before it (ids[j - 1], streams[j - 1]) and writes
        ids[j], streams[j]. A row's slot there comes from its block table where it has a block
        (row_blocks) and the position is under max_model_len; else it writes no KV and attends
        to a context of one token (a draft the host drops: take_drafts)."""
        num = last.shape[0]
        tables = meta.block_tables[:num]
        slots, seq_lens, at = (buffer[:num] for buffer in self.pass_inputs)
        ops.draft_pass_inputs(
            last, j, drafting, self.row_blocks[:num], tables, self.layout.block_size,
            self.max_model_len, slots, seq_lens, at,
        )  # fmt: skip
        pass_meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=seq_lens,
            query_start_loc=self.row_starts[: num + 1],
            max_query_len=1,
            max_seq_len=min(meta.max_seq_len + j, self.max_model_len),
        )
        before = self.ids[j - 1, :num], self.streams[j - 1, :num]
        normed, stream = self.head(before[0], at, before[1], self.kv_caches[0], pass_meta)
        self.ids[j, :num] = self.head.draft_ids(normed)
        self.streams[j, :num] = stream

    def capture_graphs(self, target_graphs: StepGraphs) -> None:
        """CUDA graphs of the catch-up and the draft passes after it, one for each of the
        target's (the same step buffers, the same shapes): a head's pass is a few dozen small
        kernels, whose launches from Python would cost more than the GPU's work."""
        self.draft_at.fill_(-1)  # the captures draft nothing and write no draft KV
        self.row_blocks.zero_()
        graphs = StepGraphs(
            self._catch_up_forward,
            target_graphs.buffers,
            target_graphs.max_reqs,
            target_graphs.max_seq_len,
            mixed=bool(target_graphs.mixed_sizes),
            name="the EAGLE-3 head",
        )
        with torch.inference_mode():
            graphs.capture()
        self.catch_up_graphs = graphs
