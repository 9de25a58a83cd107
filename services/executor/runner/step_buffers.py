"""One step's integer inputs, packed so that a step costs one host-to-device copy.

Every field lives at a fixed offset of one int32 buffer, sized for the largest step:

    input_ids [T] | positions [T] | slot_mapping [G, T] | source_rows [T] | token_slots [T]
    | token_order [T] | query_start_loc [R+1] | seq_lens [R] | sample_rows [S]
    | block_tables [R, G, max_blocks]   (T, R, S: the configured maxima; G: layer groups)

With layer groups (shared/kv_groups.py), each group has its own block table and KV slots: a
request's blocks come as one of each group's in turn (logical block i of group g at
i * G + g), and a layer attends with its group's (`AttentionMetadata.of_group`).

The host fills a pinned mirror, and one asynchronous copy moves the used prefix to the GPU.
Fixed offsets also make the device views stable, which CUDA graphs need: a graph captured on
`view(...)` reads whatever the latest copy put there. On the CPU the mirror is the buffer.

`source_rows` is where a token's input comes from. In the target's steps, it is how a step
runs before the host knows all of its input tokens: a decode whose input is the token the step
in flight is still sampling names that token's row in the device's last sampled ids (-1
elsewhere), and the forward pass gathers it on the device.
`token_slots` is each token's LoRA slot (-1: the base model) and `token_order` the tokens
sorted by it (the LoRA kernels read each adapter once per block of its tokens), written when
LoRA is on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from services.executor.layers.attention_metadata import AttentionMetadata
from services.executor.layers.lora import LoraTokens
from services.executor.layers.rotary import LongRope

PADDING_SLOT = -1  # write_kv skips it: padded graph rows must not touch the cache
# At most this many tokens and rows: StepBuffers lays a step out token by token (1 row of 9
# tokens: 8.7 against 23.7 us; 16 rows of one 18.7 against 26.3; 32 rows 29.3 against 26.6).
SMALL_STEP_TOKENS, SMALL_STEP_ROWS = 32, 16


class _Layout(NamedTuple):
    """Where a step's tokens go: per token its position, KV slot and request; per request the
    index of its first token (and one past the last) and its length once the step has run."""

    positions: Sequence[int] | np.ndarray
    slots: Sequence[Sequence[int]] | np.ndarray  # [G, T]: each layer group's
    query_start: Sequence[int] | np.ndarray
    seq_lens: Sequence[int] | np.ndarray
    req_index: Sequence[int] | np.ndarray


@dataclass(frozen=True)
class PaddedShape:
    """The fixed shape a step is padded to, so that a CUDA graph captured on it replays it."""

    num_tokens: int
    num_reqs: int
    # The most tokens of a request, which picks attention's kernels (ops.paged_attention): 1,
    # a decode step; up to StepBuffers.decode_queries, a step of verifying rows (a token and
    # its drafts each: the decode kernel too); num_tokens, any mix (prompts: prefill kernel).
    max_query_len: int

    @property
    def decode(self) -> bool:
        return self.max_query_len == 1


@dataclass
class StepView:
    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    source_rows: torch.Tensor  # [T] int32: row of the last sampled ids to take, or -1
    lora: LoraTokens  # LoRA slot of each token (-1: none) and their order (with LoRA only)
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] int32: flat index of each sampled position


class StepBuffers:
    def __init__(
        self,
        max_tokens: int,
        max_reqs: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
        max_samples: int | None = None,
        decode_queries: int = 1,
        long_rope: LongRope | None = None,
        num_groups: int = 1,
    ) -> None:
        """`max_samples`: positions sampled in one step, at most (default one a request; more
        where a row verifies drafts). `decode_queries`: the most tokens of a request that
        attention reads its context for as a decode (AttentionMetadata), 1 + the drafts of a
        verifying row."""
        self.max_tokens, self.max_reqs, self.max_blocks = max_tokens, max_reqs, max_blocks
        self.num_groups = num_groups
        self.decode_queries = decode_queries
        self.long_rope = long_rope  # LongRoPE: positions offset into its long set (write)
        self.max_samples = min(max_samples or max_reqs, max(max_tokens, max_reqs))
        self.block_size = block_size
        sizes = {
            "input_ids": max_tokens,
            "positions": max_tokens,
            "slot_mapping": num_groups * max_tokens,
            "source_rows": max_tokens,
            "token_slots": max_tokens,
            "token_order": max_tokens,
            "query_start_loc": max_reqs + 1,
            "seq_lens": max_reqs,
            "sample_rows": self.max_samples,
            "block_tables": max_reqs * num_groups * max_blocks,
        }
        self.offsets: dict[str, int] = {}
        total = 0
        for name, size in sizes.items():
            self.offsets[name] = total
            total += size
        pin = device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=pin)
        self.device_buffer = self.host.to(device) if pin else self.host
        self.np = self.host.numpy()
        self.tables = self._host("block_tables", max_reqs * num_groups * max_blocks).reshape(
            max_reqs, num_groups, max_blocks
        )
        # Set once the last copy has read the mirror: a pipelined caller fills the mirror for
        # step k+1 while step k may still be queued, copy included.
        self._copied: torch.cuda.Event | None = None
        self.last_step: tuple[int, int, int, int] = (0, 0, 0, 0)  # T, R, S, max_seq_len

    def _host(self, name: str, size: int) -> np.ndarray:
        start = self.offsets[name]
        return self.np[start : start + size]

    def field(self, name: str, size: int) -> torch.Tensor:
        """The first `size` entries of a field on the device, as the last copy left them."""
        start = self.offsets[name]
        return self.device_buffer[start : start + size]

    def set_table_row(self, row: int, block_ids: Sequence[int], start: int = 0) -> None:
        """Blocks start.. of the request in `row` (every group's in turn); rows persist
        between steps.

        NOTE: the caller calls `wait_for_copy` first once per step (not here: once per row).
        """
        groups = self.num_groups
        if len(block_ids) > start:
            new = np.asarray(block_ids[start:]).reshape(-1, groups).T  # [G, new blocks]
            first = start // groups
            self.tables[row, :, first : first + new.shape[1]] = new

    def write(
        self,
        token_ids: Sequence[int],
        starts: Sequence[int],
        counts: Sequence[int],
        sample_rows: Sequence[int],
        pad_to: PaddedShape | None = None,
        sources: Sequence[tuple[int, int]] = (),
        row_slots: Sequence[int] | None = None,
        long_rows: Sequence[bool] = (),
    ) -> None:
        """Fill the host mirror for one step; `pad_to` pads it to a CUDA graph's shape.

        Request r computes tokens starts[r] : starts[r] + counts[r], whose ids are the
        concatenated `token_ids`; its blocks are in table row r (`set_table_row`). Each
        (token index, row) of `sources` replaces that token id by the row of the last sampled
        ids, on the device. `row_slots`: each request's LoRA slot, with LoRA. `long_rows`:
        whether each request takes LongRoPE's long set (the positions field is then each
        token's row of the rotary table: `LongRope.rotary_positions`).
        """
        num_reqs, num_tokens = len(counts), len(token_ids)
        if num_tokens > self.max_tokens or num_reqs > self.max_reqs:
            raise ValueError(f"step of {num_tokens} tokens / {num_reqs} requests exceeds buffers")
        self.wait_for_copy()
        if num_tokens <= SMALL_STEP_TOKENS and num_reqs <= SMALL_STEP_ROWS:
            layout = self._layout_small(starts, counts)
        else:
            layout = self._layout(starts, counts, num_tokens)
        self._host("input_ids", num_tokens)[:] = token_ids
        self._host("positions", num_tokens)[:] = self._rotary_positions(layout, long_rows)
        for group, slots in enumerate(layout.slots):
            self._slots(group, num_tokens)[:] = slots
        source_rows = self._host("source_rows", num_tokens)
        source_rows[:] = -1
        if sources:
            indices, rows = zip(*sources, strict=True)
            source_rows[list(indices)] = rows
        if row_slots is not None:
            self._host("token_slots", num_tokens)[:] = np.asarray(row_slots)[layout.req_index]
        self._host("query_start_loc", num_reqs + 1)[:] = layout.query_start
        seq_lens = self._host("seq_lens", num_reqs)
        seq_lens[:] = layout.seq_lens
        self._host("sample_rows", len(sample_rows))[:] = sample_rows
        max_seq_len = int(seq_lens.max()) if num_reqs else 0
        if pad_to is not None:
            if pad_to.decode:
                self._pad_decode(num_reqs, pad_to.num_reqs)
            else:
                self._pad_mixed(num_tokens, num_reqs, pad_to)
            num_tokens, num_reqs = pad_to.num_tokens, pad_to.num_reqs
        if row_slots is not None:  # padding included: its tokens have no slot
            slots = self._host("token_slots", num_tokens)
            self._host("token_order", num_tokens)[:] = np.argsort(slots, kind="stable")
        self.last_step = (num_tokens, num_reqs, len(sample_rows), max_seq_len)

    def _slots(self, group: int, size: int) -> np.ndarray:
        """The first `size` KV slots of a group's tokens, in the host mirror."""
        start = self.offsets["slot_mapping"] + group * self.max_tokens
        return self.np[start : start + size]

    def _rotary_positions(self, layout: _Layout, long_rows: Sequence[bool]) -> object:
        """The positions the rotary kernel reads: with LongRoPE, a long request's offset into
        its long set."""
        if self.long_rope is None or not any(long_rows):
            return layout.positions
        positions = np.asarray(layout.positions, dtype=np.int64)
        rows = np.asarray(layout.req_index, dtype=np.int64)
        return self.long_rope.rotary_positions(positions, np.asarray(long_rows)[rows])

    def _layout(self, starts: Sequence[int], counts: Sequence[int], num_tokens: int) -> _Layout:
        """Each token's position and KV slot, and each request's bounds, by array operations."""
        count = np.asarray(counts, dtype=np.int64)
        first = np.cumsum(count) - count  # [R] offset of each request's first token
        req_index = np.repeat(np.arange(len(counts)), count)  # [T]
        positions = np.asarray(starts, dtype=np.int64)[req_index] + np.arange(num_tokens)
        positions -= first[req_index]
        block_of = self.tables[req_index, :, positions // self.block_size].astype(np.int64)
        slots = block_of.T * self.block_size + positions % self.block_size  # [G, T]
        query_start = np.concatenate([[0], np.cumsum(count)])
        seq_lens = positions[first + count - 1] + 1 if len(counts) else []
        return _Layout(positions, slots, query_start, seq_lens, req_index)

    def _layout_small(self, starts: Sequence[int], counts: Sequence[int]) -> _Layout:
        """`_layout` token by token: for a few tokens (a decode at small batch, a verifying
        row), faster than the array operations' fixed cost of some microseconds each."""
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(self.num_groups)]
        req_index: list[int] = []
        query_start, seq_lens = [0], []
        size = self.block_size
        for row, (start, count) in enumerate(zip(starts, counts, strict=True)):
            tables = self.tables[row]
            for position in range(start, start + count):
                positions.append(position)
                for group, group_slots in enumerate(slots):
                    block = int(tables[group, position // size])
                    group_slots.append(block * size + position % size)
            req_index += [row] * count
            query_start.append(query_start[-1] + count)
            seq_lens.append(start + count)
        return _Layout(positions, slots, query_start, seq_lens, req_index)

    def _pad_tokens(self, num_tokens: int, size: int) -> None:
        """Tokens num_tokens..size: token 0 at position 0, writing no KV, gathering nothing."""
        pad = slice(num_tokens, size)
        self._host("input_ids", size)[pad] = 0
        self._host("positions", size)[pad] = 0
        for group in range(self.num_groups):
            self._slots(group, size)[pad] = PADDING_SLOT
        self._host("source_rows", size)[pad] = -1
        self._host("token_slots", size)[pad] = -1

    def _pad_decode(self, num_reqs: int, size: int) -> None:
        """Rows num_reqs..size: one harmless token each (read block 0, write nowhere)."""
        self._pad_tokens(num_reqs, size)
        self._host("query_start_loc", size + 1)[num_reqs + 1 :] = np.arange(num_reqs + 1, size + 1)
        self._host("seq_lens", size)[num_reqs:] = 1
        self.tables[num_reqs:size, :, 0] = 0

    def _pad_mixed(self, num_tokens: int, num_reqs: int, shape: PaddedShape) -> None:
        """Tokens past num_tokens belong to no request and write nowhere; requests past
        num_reqs have no tokens (no attention work, no block-table reads)."""
        if num_tokens > shape.num_tokens or num_reqs > shape.num_reqs:
            raise ValueError(f"a step of {num_tokens} tokens / {num_reqs} requests > {shape}")
        self._pad_tokens(num_tokens, shape.num_tokens)
        self._host("query_start_loc", shape.num_reqs + 1)[num_reqs + 1 :] = num_tokens
        self._host("seq_lens", shape.num_reqs)[num_reqs:] = 0

    def copy_to_device(self) -> None:
        """One copy of everything up to the last used block-table row."""
        if self.device_buffer is self.host:
            return
        num_reqs = self.last_step[1]
        end = self.offsets["block_tables"] + num_reqs * self.num_groups * self.max_blocks
        self.device_buffer[:end].copy_(self.host[:end], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def wait_for_copy(self) -> None:
        """Block until the last copy has read the mirror (at once, unless it is still queued)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def view(self, max_seq_len: int | None = None, max_query_len: int | None = None) -> StepView:
        """Device tensors of the last written step; a graph's capture fixes the bounds that
        pick kernels (max_seq_len, max_query_len) for every step it will replay."""
        num_tokens, num_reqs, num_samples, step_max_seq_len = self.last_step
        if max_query_len is None:
            qsl_host = self._host("query_start_loc", num_reqs + 1)
            max_query_len = int(np.diff(qsl_host).max()) if num_reqs else 0
        start = self.offsets["block_tables"]
        size = num_reqs * self.num_groups * self.max_blocks
        tables = self.device_buffer[start : start + size].view(num_reqs, self.num_groups, -1)
        slots = self.offsets["slot_mapping"]
        metas = [
            AttentionMetadata(
                slot_mapping=self.device_buffer[slots + g * self.max_tokens :][:num_tokens],
                block_tables=tables[:, g],  # rows G tables apart: the kernels take the stride
                seq_lens=self.field("seq_lens", num_reqs),
                query_start_loc=self.field("query_start_loc", num_reqs + 1),
                max_query_len=max_query_len,
                max_seq_len=max_seq_len if max_seq_len is not None else step_max_seq_len,
                decode_queries=self.decode_queries,
            )
            for g in range(self.num_groups)
        ]
        meta = metas[0]
        if self.num_groups > 1:
            meta.groups = metas
        return StepView(
            input_ids=self.field("input_ids", num_tokens),
            positions=self.field("positions", num_tokens),
            source_rows=self.field("source_rows", num_tokens),
            lora=LoraTokens(
                self.field("token_slots", num_tokens), self.field("token_order", num_tokens)
            ),
            meta=meta,
            sample_rows=self.field("sample_rows", num_samples),
        )
