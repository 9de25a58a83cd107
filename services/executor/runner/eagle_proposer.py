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
target's embedding, gathered from the ranks at load). On a GPU each pass replays a CUDA graph:
the catch-up's, first drafts included, then one a further draft; what the host does between
them is to lay out and copy each pass's inputs.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kernels import ops
from services.executor.loading.loader import load_eagle3_head
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.runner.cuda_graphs import Forward, StepGraphs
from services.executor.runner.kv_cache import KVCacheLayout
from services.executor.runner.step_buffers import StepBuffers, StepView
from services.executor.speculative import RowSpan, SpeculatingRequest
from shared.config import Config
from shared.model_config import resolve_model_source
from shared.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


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
        max_blocks = -(-max_model_len // config.block_size)
        args = (config.max_num_seqs, max_blocks, config.block_size, device)
        # A catch-up row feeds a verified row's tokens: up to 1 + the drafts, read as decodes.
        self.catch_up_buffers = StepBuffers(
            config.max_num_batched_tokens, *args, decode_queries=1 + self.num_drafts
        )
        # One per further draft: each pass's inputs are copied before the first runs.
        self.draft_buffers = [
            StepBuffers(config.max_num_seqs, *args) for _ in range(self.num_drafts - 1)
        ]
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
        self.draft_graphs: list[StepGraphs] = []
        self.max_seq_len = max_model_len
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
        """The catch-up pass and the draft passes; each drafting row's drafts land in it."""
        if not rows:
            return
        # Drafting rows first, most drafts first: pass j's rows are a prefix of pass j-1's.
        rows.sort(key=lambda row: -row.num_drafts)
        drafting = [row for row in rows if row.num_drafts]
        self._catch_up(rows, drafting, hidden)
        if not drafting:
            return
        num_columns = 1
        for j, buffers in enumerate(self.draft_buffers, start=1):
            going = [row for row in drafting if row.num_drafts > j]
            if not going:
                break
            self._draft_pass(buffers, going, j)
            num_columns += 1
        drafts = self.ids[:num_columns, : len(drafting)].T.tolist()  # the one wait
        for row, row_drafts in zip(drafting, drafts, strict=True):
            row.drafts = row_drafts[: row.num_drafts]

    def _catch_up(self, rows: list[_Row], drafting: list[_Row], hidden: torch.Tensor) -> None:
        """The pass over every row's positions fed; the drafting rows' first drafts and
        streams go to ids[0] and streams[0]."""
        buffers = self.catch_up_buffers
        buffers.wait_for_copy()
        for index, row in enumerate(rows):
            buffers.set_table_row(index, row.blocks)
        counts = [len(row.tokens) for row in rows]
        ends = [end - 1 for end in itertools.accumulate(counts[: len(drafting)])]
        tokens = [token for row in rows for token in row.tokens]
        graphs = self.catch_up_graphs
        shape = graphs.shape_for(len(rows), len(tokens), max(counts)) if graphs else None
        if shape is not None:  # the graph drafts for every row it holds: padding picks token 0
            ends += [0] * (shape.num_reqs - len(ends))
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
        """The head at each position fed; at each sample row (a drafting row's last position)
        its first draft and stream, to ids[0] and streams[0]. Returns the streams [T, hidden]."""
        hidden = self.hidden_in[: view.input_ids.shape[0]]
        normed, stream = self.head(
            view.input_ids, view.positions, hidden, self.kv_caches[0], view.meta
        )
        num = view.sample_rows.shape[0]
        if num:
            self.ids[0, :num] = self.head.draft_ids(torch.index_select(normed, 0, view.sample_rows))
            torch.index_select(stream, 0, view.sample_rows, out=self.streams[0, :num])
        return stream

    def _draft_pass(self, buffers: StepBuffers, rows: list[_Row], j: int) -> None:
        """The pass for each row's draft j + 1, at the position after its draft j's: reads
        ids[j - 1] and streams[j - 1], writes ids[j] and streams[j]."""
        buffers.wait_for_copy()
        for index, row in enumerate(rows):
            buffers.set_table_row(index, row.blocks)
        num = len(rows)
        # A row's last fed position is start + len(tokens) - 1; draft j is the token after
        # the position j past it.
        starts = [row.start + len(row.tokens) - 1 + j for row in rows]
        sources = [(index, index) for index in range(num)]
        graphs = self.draft_graphs[j - 1] if self.draft_graphs else None
        shape = graphs.shape_for(num, num, 1) if graphs is not None else None
        buffers.write([0] * num, starts, [1] * num, list(range(num)), shape, sources)
        buffers.copy_to_device()
        if graphs is not None and shape is not None:
            graphs.replay(shape)
        else:
            self._draft_forward(j)(buffers.view())

    def _draft_forward(self, j: int) -> Forward:
        def forward(view: StepView) -> torch.Tensor:
            num = view.input_ids.shape[0]
            ops.gather_sampled_inputs(view.input_ids, view.source_rows, self.ids[j - 1])
            hidden = self.streams[j - 1, :num]
            kv_cache = self.kv_caches[0]
            normed, stream = self.head(view.input_ids, view.positions, hidden, kv_cache, view.meta)
            self.ids[j, :num] = self.head.draft_ids(normed)
            self.streams[j, :num] = stream
            return stream

        return forward

    def capture_graphs(self, max_seq_len: int) -> None:
        """CUDA graphs of the catch-up (decode, verifying and mixed shapes) and of each draft pass
        (decode shapes): a head's pass is a few dozen small kernels, whose launches from
        Python would cost more than the GPU's work."""
        max_reqs = self.catch_up_buffers.max_reqs
        catch_up = self._catch_up_forward
        name = "the EAGLE-3 catch-up"
        self.catch_up_graphs = StepGraphs(
            catch_up, self.catch_up_buffers, max_reqs, max_seq_len, name=name
        )
        self.draft_graphs = [
            StepGraphs(
                self._draft_forward(j),
                buffers,
                max_reqs,
                max_seq_len,
                mixed=False,
                name=f"EAGLE-3 draft {j + 1}",
            )
            for j, buffers in enumerate(self.draft_buffers, start=1)
        ]
        with torch.inference_mode():
            for graphs in [self.catch_up_graphs, *self.draft_graphs]:
                graphs.capture()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Capture the head's graphs, then meet its kernels before the first request: `project`
        (eager, in every step) on each of the skinny GEMV's row tiles (1, 16, 32, 64 rows),
        catch-ups of an odd token count and of a multiple of 16 (eagerly: of each prefill row
        tile too), and draft passes of 1 to 80 rows. Every row uses blocks from 0 up, which no
        request holds yet."""
        if self.use_graphs and self.catch_up_graphs is None:
            self.capture_graphs(self.max_seq_len)
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
