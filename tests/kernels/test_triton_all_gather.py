"""The logits all-gather over symmetric memory (kernels/triton_all_gather.py).

On the CPU, under TRITON_INTERPRET, one process plays one rank of a group whose other ranks
already wrote their slots: the kernel must lay every rank's part in place, empty those slots
again (-0.0), send its own to every peer and count its calls. Two real
ranks on two GPUs are tested in tests/integration/test_gpu_fused_all_reduce.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.all_gather import SLOT_WIDTH, all_gather_reference, gather_takes, slots_per_row
from kernels.peers import PeerBuffers
from kernels.triton_all_gather import all_gather

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU only; on GPUs: test_gpu_fused_all_reduce.py"
)
PART = 2 * SLOT_WIDTH + 40  # three slots a row, the last one short
MAX_ROWS = 3


def _group(world: int, rank: int, max_programs: int = 4) -> PeerBuffers:
    """Four programs at most: a call of 2 rows (6 slots) makes some take two slots."""
    slots = MAX_ROWS * slots_per_row(PART)
    data = tuple(torch.full((2, world, slots, SLOT_WIDTH), -0.0) for _ in range(world))
    return PeerBuffers.of(rank, data, max_programs)


def _peers_arrive(peers: PeerBuffers, parts: list[torch.Tensor]) -> None:
    """What the other ranks do first in this call: write their slots."""
    per_row = slots_per_row(PART)
    for slot in range(parts[0].shape[0] * per_row):
        row, first = divmod(slot, per_row)
        cols = slice(first * SLOT_WIDTH, min((first + 1) * SLOT_WIDTH, PART))
        epoch = (peers.epochs[slot] + 1).item()
        for rank, part in enumerate(parts):
            if rank != peers.rank:
                width = cols.stop - cols.start
                peers.data[peers.rank][epoch & 1, rank, slot, :width] = part[row, cols]


@pytest.mark.parametrize(("world", "rank"), [(2, 0), (2, 1), (4, 3)])
def test_rank_lays_every_ranks_part_in_place(world: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(world + rank)
    peers = _group(world, rank)
    for rows in (2, 1, 3):
        parts = [torch.randn(rows, PART, generator=gen) for _ in range(world)]
        _peers_arrive(peers, parts)
        expected = all_gather_reference(parts[rank], peers)
        assert torch.equal(expected, torch.cat(parts, dim=-1))
        assert torch.equal(all_gather(parts[rank], peers), expected)
        per_row = slots_per_row(PART)
        for slot in range(rows * per_row):  # its slots sent to every peer, theirs taken
            row, first = divmod(slot, per_row)
            cols = slice(first * SLOT_WIDTH, min((first + 1) * SLOT_WIDTH, PART))
            width, half = cols.stop - cols.start, int(peers.epochs[slot]) & 1
            for peer in set(range(world)) - {rank}:
                sent = peers.data[peer][half, rank, slot, :width]
                assert torch.equal(sent, parts[rank][row, cols])
                taken = peers.data[rank][half, peer, slot].view(torch.int32)
                assert (taken == -(2**31)).all()  # -0.0: empty again
    assert peers.epochs.tolist() == [3] * 3 + [2] * 3 + [1] * 3


def test_parts_that_do_not_fit_are_refused() -> None:
    peers = _group(2, 0)  # nine slots: three rows of three slots, or two rows of four
    assert gather_takes(peers, torch.zeros(MAX_ROWS, PART))
    assert gather_takes(peers, torch.zeros(2, 4 * SLOT_WIDTH))
    for part in (
        torch.zeros(MAX_ROWS + 1, PART),
        torch.zeros(3, 4 * SLOT_WIDTH),
        torch.zeros(1, PART, dtype=torch.float16),
        torch.zeros(1, 2 * PART)[:, ::2],
    ):
        assert not gather_takes(peers, part)
        with pytest.raises(ValueError, match="does not fit the buffers"):
            all_gather(part, peers)
