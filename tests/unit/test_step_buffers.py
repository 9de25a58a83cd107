"""The packed step inputs and how steps are padded to the CUDA graphs' shapes (on CPU)."""

from __future__ import annotations

import itertools
import unittest.mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.executor.parallel.replica_experts import StepRows
from services.executor.runner import step_buffers
from services.executor.runner.cuda_graphs import (
    DECODE_GRAPH_MAX_BATCH,
    MIXED_GRAPH_MAX_TOKENS,
    StepGraphs,
)
from services.executor.runner.step_buffers import PADDING_SLOT, PaddedShape, StepBuffers

BLOCK = 4


def buffers_with_two_requests() -> StepBuffers:
    """A decode of request 0 (position 5) and a 3-token prompt chunk of request 1."""
    buffers = StepBuffers(
        max_tokens=64, max_reqs=8, max_blocks=4, block_size=BLOCK, device=torch.device("cpu")
    )
    buffers.set_table_row(0, [7, 2])
    buffers.set_table_row(1, [5])
    return buffers


def test_mixed_padding_adds_ownerless_tokens_and_empty_requests() -> None:
    buffers = buffers_with_two_requests()
    shape = PaddedShape(num_tokens=16, num_reqs=8, max_query_len=16)
    buffers.write([11, 12, 13, 14], [5, 0], [1, 3], [0, 3], pad_to=shape)
    view = buffers.view()
    assert view.input_ids.tolist()[:4] == [11, 12, 13, 14]
    assert view.input_ids.shape == (16,) and view.meta.seq_lens.shape == (8,)
    assert view.meta.slot_mapping.tolist()[:4] == [
        2 * BLOCK + 1,
        5 * BLOCK,
        5 * BLOCK + 1,
        5 * BLOCK + 2,
    ]
    assert view.meta.slot_mapping.tolist()[4:] == [PADDING_SLOT] * 12  # no KV written
    assert view.source_rows.tolist()[4:] == [-1] * 12
    # Requests 2..7 hold no tokens, and the padding tokens belong to none.
    assert view.meta.query_start_loc.tolist() == [0, 1, 4, 4, 4, 4, 4, 4, 4]
    assert view.meta.seq_lens.tolist() == [6, 3, 0, 0, 0, 0, 0, 0]
    assert view.meta.max_query_len == 3
    assert view.sample_rows.tolist() == [0, 3]


def test_decode_padding_gives_each_row_one_harmless_token() -> None:
    buffers = buffers_with_two_requests()
    buffers.write([11, 12], [5, 3], [1, 1], [0, 1], pad_to=PaddedShape(4, 4, max_query_len=1))
    view = buffers.view()
    assert view.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert view.meta.seq_lens.tolist() == [6, 4, 1, 1]
    assert view.meta.slot_mapping.tolist()[2:] == [PADDING_SLOT] * 2


def test_a_step_larger_than_its_shape_is_refused() -> None:
    buffers = buffers_with_two_requests()
    with pytest.raises(ValueError, match="tokens"):
        buffers.write([11, 12, 13, 14], [5, 0], [1, 3], [0, 3], pad_to=PaddedShape(2, 2, 2))


def test_graph_shapes_cover_every_step_up_to_the_limit() -> None:
    buffers = StepBuffers(2048, 256, 8, BLOCK, torch.device("cpu"))
    graphs = StepGraphs(lambda view: view.input_ids, buffers, max_batch=256, max_seq_len=32)
    assert graphs.shape_for(1, 1, 1) == PaddedShape(1, 1, 1)
    assert graphs.shape_for(3, 3, 1) == PaddedShape(4, 4, 1)
    assert graphs.shape_for(33, 232, 100) == PaddedShape(256, 256, 256)
    assert graphs.shape_for(1, 17, 17) == PaddedShape(32, 32, 32)
    assert graphs.shape_for(2, 4, 3) == PaddedShape(16, 16, 16)  # no drafts: no verifying graphs
    assert graphs.shape_for(2, MIXED_GRAPH_MAX_TOKENS + 1, 500) is None  # eager
    for num_tokens in range(1, MIXED_GRAPH_MAX_TOKENS + 1):
        for num_reqs in {1, num_tokens // 2 or 1, min(num_tokens, 256)}:
            longest = num_tokens - num_reqs + 1
            shape = graphs.shape_for(num_reqs, num_tokens, longest)
            assert shape is not None
            assert shape.num_tokens >= num_tokens and shape.num_reqs >= num_reqs
            assert shape.decode == (num_reqs == num_tokens)


def test_verifying_steps_get_graphs_of_their_batch_size() -> None:
    """Up to 1 + 3 drafts a request: a shape of the batch's size (the decode kernel's split
    count follows it), padded as a mixed step; a longer row, a mixed shape."""
    buffers = StepBuffers(2048, 256, 8, BLOCK, torch.device("cpu"), decode_queries=4)
    graphs = StepGraphs(lambda view: view.input_ids, buffers, max_batch=256, max_seq_len=32)
    assert graphs.verify_sizes[-1] == 128  # 512 tokens, the mixed graphs' limit
    assert graphs.shape_for(1, 4, 4) == PaddedShape(4, 1, 4)
    assert graphs.shape_for(3, 7, 4) == PaddedShape(16, 4, 4)
    assert graphs.shape_for(3, 3, 1) == PaddedShape(4, 4, 1)  # no drafts: a decode
    assert graphs.shape_for(2, 6, 5) == PaddedShape(16, 16, 16)  # a prompt chunk
    assert graphs.shape_for(129, 400, 4) == PaddedShape(448, 256, 448)
    buffers.write([1, 2, 3, 4, 5], [10, 3], [4, 1], [3, 4], pad_to=PaddedShape(12, 3, 4))
    assert buffers.last_step[:2] == (12, 3)
    assert buffers.view().meta.query_start_loc.tolist() == [0, 4, 5, 5]
    assert buffers.view().meta.decode_queries == 4
    decode_only = StepGraphs(lambda view: view.input_ids, buffers, 256, 32, mixed=False)
    assert decode_only.shape_for(1, 4, 4) is None and not decode_only.verify_sizes


def test_decode_steps_past_the_graph_limit_run_eagerly_rather_than_padded() -> None:
    """--max-num-seqs 1024: a step of 513 rows is not padded to 1024 (twice its work)."""
    buffers = StepBuffers(2048, 1024, 8, BLOCK, torch.device("cpu"))
    graphs = StepGraphs(lambda view: view.input_ids, buffers, max_batch=1024, max_seq_len=32)
    limit = DECODE_GRAPH_MAX_BATCH
    assert graphs.shape_for(limit, limit, 1) == PaddedShape(limit, limit, 1)
    assert graphs.shape_for(limit - 15, limit - 15, 1) == PaddedShape(limit, limit, 1)
    assert graphs.shape_for(limit + 1, limit + 1, 1) is None
    assert graphs.shape_for(1000, 1000, 1) is None
    small = StepGraphs(lambda view: view.input_ids, buffers, max_batch=300, max_seq_len=32)
    assert small.shape_for(290, 290, 1) == PaddedShape(300, 300, 1)  # max_batch's own


@given(most=st.integers(1, 600), longest=st.integers(0, 600), mixed=st.booleans())
def test_replicas_agree_on_a_graph_every_one_of_them_can_replay(
    most: int, longest: int, mixed: bool
) -> None:
    """Across replicas (services/executor/runner/replica_rounds.py): the round's rows are the
    smallest graph's that holds the most any replica runs, a mixed one's if some replica's step
    is mixed, else decode or mixed; a replica's step (its most tokens a request: `longest`, 0
    with none; more than 1 only in a mixed round) replays a graph of exactly those rows where
    one of its kind was captured: a decode step a decode graph, else a mixed one. So in a
    mixed round every replica replays a graph wherever the most rows fit a mixed one."""
    longest = longest if mixed else min(longest, 1)
    buffers = StepBuffers(2048, 256, 8, BLOCK, torch.device("cpu"))
    graphs = StepGraphs(lambda view: view.input_ids, buffers, max_batch=256, max_seq_len=32)
    sizes = graphs.mixed_sizes if mixed else sorted({*graphs.decode_sizes, *graphs.mixed_sizes})
    rows = graphs.rows_for(most, mixed)
    assert rows == min((s for s in sizes if s >= most), default=most)
    shape = graphs.shape_at(rows, longest)
    if shape is None:
        assert rows not in graphs.mixed_sizes
        assert longest > 1 or rows not in graphs.decode_sizes
    else:
        assert shape.num_tokens == rows
        assert shape.decode == (longest <= 1 and rows in graphs.decode_sizes)
    assert (shape is not None) == (rows in sizes), "a graph for every replica, or for none"
    assert graphs.rows_for(3) == 4 and graphs.rows_for(250) == 256 and graphs.rows_for(257) == 320
    assert graphs.shape_at(320, 1) == PaddedShape(320, 256, 320)  # a decode in a mixed graph
    assert graphs.shape_at(24, 5) is None  # a mixed step where only a decode graph has 24
    assert graphs.rows_for(20, mixed=True) == 32  # so a mixed round takes a mixed graph's rows


def test_the_replicas_rows_mask_padding_from_the_device_when_graphs_replay() -> None:
    """A step's padding mask across replicas: the host's rows without graphs (none when every
    replica runs as many as they send); with graphs, made from the rows on the device that
    each step's `set` refreshes, padded beyond the most any replica runs when a graph's are."""
    step = StepRows()
    step.set([3, 3])
    assert step.padded == 3 and step.padding(torch.device("cpu")) is None
    step.set([3, 1])
    assert step.padding(torch.device("cpu")).tolist() == [[False] * 3, [False, True, True]]
    graphs = StepRows()
    graphs.keep_on_device(2, torch.device("cpu"))
    graphs.set([3, 3], padded_to=4)
    assert graphs.padded == 4
    assert graphs.padding(torch.device("cpu")).tolist() == [[False] * 3 + [True]] * 2
    graphs.set([1, 4], padded_to=4)
    assert graphs.on_device is not None and graphs.on_device.tolist() == [1, 4]
    assert graphs.padding(torch.device("cpu")).tolist() == [[False] + [True] * 3, [False] * 4]


@settings(max_examples=120, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=20),
    lora=st.booleans(),
)
def test_a_small_step_is_laid_out_as_the_array_path_lays_it_out(
    rows: list[tuple[int, int]], lora: bool
) -> None:
    """Token by token (few tokens and rows) or by array operations, the same buffer: every
    position, slot, row bound and LoRA slot."""
    written = []
    for small in (True, False):
        buffers = StepBuffers(
            max_tokens=256, max_reqs=32, max_blocks=16, block_size=BLOCK, device=torch.device("cpu")
        )
        for row in range(len(rows)):
            buffers.set_table_row(row, [(7 * row + 3 * b) % 64 for b in range(16)])
        starts, counts = [s for s, _ in rows], [c for _, c in rows]
        tokens = list(range(sum(counts)))
        samples = list(itertools.accumulate(counts, initial=-1))[1:]
        slots = [row % 3 - 1 for row in range(len(rows))] if lora else None
        limits = (10**6, 10**6) if small else (0, 0)
        with unittest.mock.patch.multiple(
            step_buffers, SMALL_STEP_TOKENS=limits[0], SMALL_STEP_ROWS=limits[1]
        ):
            buffers.write(tokens, starts, counts, samples, None, [], slots)
        written.append((buffers.host.clone(), buffers.last_step))
    assert torch.equal(written[0][0], written[1][0]) and written[0][1] == written[1][1]
