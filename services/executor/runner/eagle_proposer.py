"""Speculative decoding's `eagle3` method: an EAGLE-3 head (services/executor/models/eagle3.py)
guesses each request's next tokens from the target's hidden states.

Every step of the target writes the residual streams entering three of its layers into one
buffer; `project` turns the step's rows into the head's input (its `fc`) on the device, after
the step's sampling (before the next step's forward pass), and the step keeps them until read.
Once the step's tokens are known on the host (runner/drafting.py: once a step, in order),
`propose_step` runs on the device with one wait at the end:

- a catch-up pass over every position the step computed whose next token is now known (a
  prompt chunk's positions; a verifying row's last token and the drafts it accepted): the
  head reads the token after each position and the target's hidden state there, and writes
  its own KV cache (one layer, on the target's block ids, like a draft model's). Positions a
  request rejected got no target state worth reading: the next step computes them again.
- the catch-up's output at a request's last position gives its first draft; each further
  draft is one more pass, at the next position, reading the draft before it and the head's
  own stream (EAGLE's stand-in for the target's state there), all on the device.

So the head's KV follows the target's: every position the target computed has the head's KV
once its step is collected, prefix-cache hits and resumed requests included (their blocks
hold both). A shared prefix block's last position read the next token of the request that
computed it; another request's next token may differ, which costs acceptance, not exactness.

It runs whole on the first rank (with tensor parallelism, beside the target's part there: the
target's hidden states are whole on every rank, and the head reads a whole copy of the
target's embedding, gathered from the ranks at load). The draft passes take their inputs from
the catch-up's on the device (each row's last position fed, its blocks, the drafts before), so
on a GPU one CUDA graph replays the catch-up and every pass: the host lays out and copies the
catch-up's inputs once, and waits once.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from services.executor.layers.attention_metadata import AttentionMetadata
from services.executor.loading.loader import load_eagle3_head
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.runner.cuda_graphs import StepGraphs
from services.executor.runner.kv_cache import KVCacheLayout
from services.executor.runner.step_buffers import PADDING_SLOT, StepBuffers, StepView
from services.executor.speculative import RowSpan, SpeculatingRequest
from shared.config import Config
from shared.model_config import resolve_model_source
from shared.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)

NO_BLOCK = -1  # a catch-up table entry past a row's blocks
NO_DRAFTS = -1  # a catch-up sample row of a row that drafts nothing


@dataclass
class _Row:
    """A request the catch-up feeds: its blocks, first position fed, how many, the step's
    token index of its first, and how many drafts it gets (0: fed only)."""

    request_id: str
    blocks: list[int]
    tokens: list[int]  # the token after each position fed
    start: int
    first: int
    num_drafts: int = 0
    drafts: list[int] = field(default_factory=list)


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
        self.max_blocks = -(-max_model_len // config.block_size)
        args = (config.max_num_seqs, self.max_blocks, config.block_size, device)
        # A catch-up row feeds a verified row's tokens: up to 1 + the drafts, read as decodes.
        self.catch_up_buffers = StepBuffers(
            config.max_num_batched_tokens, *args, decode_queries=1 + self.num_drafts
        )
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        # Fixed inputs and outputs of the passes (CUDA graphs read and write them): the
        # catch-up's hidden states; each pass's drafts and streams, by row.
        hidden = self.head.config.layer.hidden_size
        rows, tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.hidden_in = torch.zeros(tokens, hidden, dtype=dtype, device=device)
        self.ids = torch.zeros(self.num_drafts, rows, dtype=torch.int64, device=device)
        self.streams = torch.zeros(self.num_drafts, rows, hidden, dtype=dtype, device=device)
        self.catch_up_graphs: StepGraphs | None = None
        # query_start_loc of a draft pass: one token a row
        self.row_starts = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.use_graphs = device.type == "cuda" and not config.enforce_eager

    def allocate(self, num_blocks: int, requests: object = None) -> None:
        """The head's KV cache (one layer), on the target's block ids."""
        self.kv_caches = self.layout.allocate(num_blocks, self.device)

    def finished(self, request_id: str, output_token_ids: list[int]) -> None:
        """Nothing is kept per request: the head's KV follows the target's steps."""

    def reset(self) -> None:
        """As `finished`."""

    @torch.inference_mode()
    def project(self, num_tokens: int) -> torch.Tensor:
        """The head's input hidden states of the step just run, [num_tokens, hidden]."""
        return self.head.project(self.aux_hidden[:num_tokens])

    @torch.inference_mode()
    def propose_step(
        self,
        spans: Sequence[RowSpan],
        hidden: torch.Tensor,
        wanted: set[str],
        requests: Mapping[str, SpeculatingRequest],
    ) -> dict[str, list[int]]:
        """Feed the head a collected step (its rows, `hidden`: project's output) and draft
        for the `wanted` requests, whose tokens are all known and none in flight."""
        rows = []
        for span in spans:
            state = requests.get(span.request_id)
            if state is None or not state.speculates:
                continue
            known = len(state.token_ids)
            fed = min(span.count, known - 1 - span.start)  # positions whose next token is known
            if fed < 1:
                continue
            tokens = state.token_ids[span.start + 1 : span.start + 1 + fed]
            row = _Row(span.request_id, state.block_ids, tokens, span.start, span.first)
            if span.request_id in wanted and span.start + fed == known - 1:
                room = min(len(state.block_ids) * self.layout.block_size, self.max_model_len)
                # Drafts past the first are passes at positions known - 1 onwards.
                row.num_drafts = max(0, min(self.num_drafts, room - known + 2))
            rows.append(row)
        self._propose(rows, hidden)
        return {row.request_id: row.drafts for row in rows if row.drafts}

    def _propose(self, rows: list[_Row], hidden: torch.Tensor) -> None:
        """The catch-up and the draft passes after it; each drafting row's drafts land in it."""
        if not rows:
            return
        rows.sort(key=lambda row: -row.num_drafts)  # drafting rows first: the passes' rows
        drafting = [row for row in rows if row.num_drafts]
        self._catch_up(rows, drafting, hidden)
        if not drafting:
            return
        num_columns = drafting[0].num_drafts
        drafts = self.ids[:num_columns, : len(drafting)].T.tolist()  # the one wait
        for row, row_drafts in zip(drafting, drafts, strict=True):
            row.drafts = row_drafts[: row.num_drafts]

    def _catch_up(self, rows: list[_Row], drafting: list[_Row], hidden: torch.Tensor) -> None:
        """The pass over every row's positions fed, then the draft passes: the drafting rows'
        drafts and streams go to ids and streams."""
        buffers = self.catch_up_buffers
        buffers.wait_for_copy()
        # A draft pass reads a row's table at most this many entries past its blocks.
        past = -(-(self.num_drafts - 1) // self.layout.block_size)
        for index, row in enumerate(rows):
            buffers.set_table_row(index, row.blocks)
            # Where the row's room ends, for a draft pass on the device: no KV written there.
            buffers.tables[index, len(row.blocks) : len(row.blocks) + past] = NO_BLOCK
        counts = [len(row.tokens) for row in rows]
        ends = [end - 1 for end in itertools.accumulate(counts[: len(drafting)])]
        tokens = [token for row in rows for token in row.tokens]
        graphs = self.catch_up_graphs
        shape = graphs.shape_for(len(rows), len(tokens), max(counts)) if graphs else None
        if shape is not None:  # the graph's other rows draft nothing; a pass reads block 0
            ends += [NO_DRAFTS] * (shape.num_reqs - len(ends))
            buffers.tables[len(rows) : shape.num_reqs, 0] = 0
        # Each position reads the target's hidden state at its row of the step (source_rows).
        step_rows = [row.first + i for row in rows for i in range(len(row.tokens))]
        starts = [row.start for row in rows]
        buffers.write(tokens, starts, counts, ends, shape, list(enumerate(step_rows)))
        buffers.copy_to_device()
        sources = buffers.field("source_rows", len(tokens))
        torch.index_select(hidden, 0, sources, out=self.hidden_in[: len(tokens)])
        if graphs is not None and shape is not None:
            graphs.replay(shape)
        else:
            self._catch_up_forward(buffers.view())

    def _catch_up_forward(self, view: StepView) -> torch.Tensor:
        """The head at each position fed, then its drafts: at each sample row (a drafting row's
        last position; NO_DRAFTS: none) the first, and each further one from a pass of its own,
        into ids and streams. Returns the streams of the positions fed [T, hidden]."""
        hidden = self.hidden_in[: view.input_ids.shape[0]]
        normed, stream = self.head(
            view.input_ids, view.positions, hidden, self.kv_caches[0], view.meta
        )
        num = view.sample_rows.shape[0]
        if num:
            drafting = view.sample_rows >= 0
            at = view.sample_rows.clamp(min=0)
            self.ids[0, :num] = self.head.draft_ids(torch.index_select(normed, 0, at))
            torch.index_select(stream, 0, at, out=self.streams[0, :num])
            last = torch.index_select(view.positions, 0, at)
            for j in range(1, self.num_drafts):
                self._draft_pass(view.meta, last + j, drafting, j)
        return stream

    def _draft_pass(
        self, meta: AttentionMetadata, positions: torch.Tensor, drafting: torch.Tensor, j: int
    ) -> None:
        """Draft j + 1 of each drafting row, at `positions` (its last position fed + j): the
        head reads draft j and its own stream before it (ids[j - 1], streams[j - 1]) and writes
        ids[j], streams[j]. Its inputs come from the catch-up's on the device: a row's blocks
        (the first rows of its table), and a slot where the row has room (a block there and a
        position under max_model_len), else none and a context of one token."""
        num = positions.shape[0]
        size = self.layout.block_size
        columns = (positions // size).clamp(max=self.max_blocks - 1).long()
        tables = meta.block_tables[:num]
        blocks = tables.gather(1, columns[:, None]).squeeze(1)
        room = drafting & (blocks >= 0) & (positions < self.max_model_len)
        slots = torch.where(room, blocks * size + positions % size, PADDING_SLOT)
        pass_meta = AttentionMetadata(
            slot_mapping=slots.to(meta.slot_mapping.dtype),
            block_tables=tables,
            seq_lens=torch.where(room, positions + 1, 1).to(meta.seq_lens.dtype),
            query_start_loc=self.row_starts[: num + 1],
            max_query_len=1,
            max_seq_len=min(meta.max_seq_len + j, self.max_model_len),
        )
        before = self.ids[j - 1, :num], self.streams[j - 1, :num]
        at = positions.clamp(max=self.max_model_len - 1)  # rotary tables end there
        normed, stream = self.head(before[0], at, before[1], self.kv_caches[0], pass_meta)
        self.ids[j, :num] = self.head.draft_ids(normed)
        self.streams[j, :num] = stream

    def capture_graphs(self, max_seq_len: int) -> None:
        """CUDA graphs of the catch-up and the draft passes after it (decode, verifying and
        mixed shapes): a head's pass is a few dozen small kernels, whose launches from Python
        would cost more than the GPU's work."""
        max_reqs = self.catch_up_buffers.max_reqs
        catch_up = self._catch_up_forward
        name = "the EAGLE-3 head"
        self.catch_up_graphs = StepGraphs(
            catch_up, self.catch_up_buffers, max_reqs, max_seq_len, name=name
        )
        with torch.inference_mode():
            self.catch_up_graphs.capture()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Capture the head's graphs, then meet its kernels before the first request: `project`
        (eager, in every step) on each of the skinny GEMV's row tiles (1, 16, 32, 64 rows),
        catch-ups of an odd token count and of a multiple of 16 (eagerly: of each prefill row
        tile too), and draft passes of 1 to 80 rows. Every row uses blocks from 0 up, which no
        request holds yet."""
        if self.use_graphs and self.catch_up_graphs is None:
            self.capture_graphs(self.max_model_len)
        for num_tokens in (1, 12, 24, 48):
            if num_tokens <= self.aux_hidden.shape[0]:
                self.project(num_tokens)
        hidden_size = self.head.config.layer.hidden_size
        for length in (37, 48) if self.use_graphs else (7, 13, 25, 37, 48):
            count = -(-(length + self.num_drafts) // self.layout.block_size)
            blocks = list(range(min(count, self.kv_caches[0].shape[1])))
            if count > len(blocks) or length > self.catch_up_buffers.max_tokens:
                continue
            for num_rows in (1, 3, 12, 24, 48, 80):
                if num_rows * length > self.catch_up_buffers.max_tokens:
                    num_rows = self.catch_up_buffers.max_tokens // length
                num_rows = min(num_rows, self.catch_up_buffers.max_reqs)
                rows = [
                    _Row("warm", blocks, [1] * length, 0, i * length, self.num_drafts)
                    for i in range(num_rows)
                ]
                hidden = torch.zeros(num_rows * length, hidden_size, device=self.device)
                self._propose(rows, hidden.to(self.head.fc.weight.dtype))
