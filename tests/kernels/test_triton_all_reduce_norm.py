"""The all-reduce fused with the residual add and RMSNorm (kernels/triton_all_reduce_norm.py).

On the CPU, under TRITON_INTERPRET, one process plays one rank of a group whose other ranks
already wrote their rows: the kernel must find them, give the reference's values, empty their
slots again (-0.0), send its own row to every peer (a -0.0 in it as +0.0) and count its calls.
Two real ranks on two GPUs are tested in tests/integration/test_gpu_fused_all_reduce.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.all_reduce_norm import all_reduce_add_rms_norm_reference
from kernels.norm import fused_add_rms_norm_reference, rms_norm_reference
from kernels.peers import PeerBuffers
from kernels.triton_all_reduce_norm import all_reduce_add_rms_norm

# One process plays every rank in host memory: the interpreter's pointers are host addresses.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU only; on GPUs: test_gpu_fused_all_reduce.py"
)
HIDDEN, MAX_ROWS, EPS = 96, 8, 1e-5


def _group(
    world: int, rank: int, max_programs: int = 2, dtype: torch.dtype = torch.float32
) -> PeerBuffers:
    """Two programs at most by default: a call of 3 rows makes one program take two rows."""
    shape = (2, world, MAX_ROWS, HIDDEN)
    data = tuple(torch.full(shape, -0.0, dtype=dtype) for _ in range(world))
    return PeerBuffers.of(rank, data, max_programs)


def _empty(slots: torch.Tensor) -> bool:
    """Whether every value is -0.0, the mark of an empty slot."""
    return bool((slots.view(torch.int32) == -(2**31)).all())


def _peers_arrive(peers: PeerBuffers, partials: list[torch.Tensor]) -> None:
    """What the other ranks do first in this call: send their rows (each row slot in the half
    of its own next epoch)."""
    for row in range(partials[0].shape[0]):
        epoch = (peers.epochs[row] + 1).item()  # int32: wraps as the kernel's does
        for rank, part in enumerate(partials):
            if rank != peers.rank:
                peers.data[peers.rank][epoch & 1, rank, row] = part[row]


@pytest.mark.parametrize(("world", "rank"), [(2, 0), (2, 1), (4, 2)])
def test_rank_sums_the_peers_rows_in_rank_order_then_adds_and_norms(world: int, rank: int):
    gen = torch.Generator().manual_seed(world * 10 + rank)
    peers = _group(world, rank)
    weight = torch.rand(HIDDEN, generator=gen) + 0.5
    for rows in [3, 1, 3]:  # row slots count their calls apart
        partials = [torch.randn(rows, HIDDEN, generator=gen) for _ in range(world)]
        residual = torch.randn(rows, HIDDEN, generator=gen)
        _peers_arrive(peers, partials)
        expected = all_reduce_add_rms_norm_reference(partials[rank], residual, weight, EPS, peers)
        total = sum(partials[1:], partials[0])  # the reference's order, as float32 adds
        assert torch.equal(expected[1], total + residual)
        normed, new_residual = all_reduce_add_rms_norm(
            partials[rank].clone(), residual.clone(), weight, EPS, peers
        )
        assert torch.equal(new_residual, expected[1])
        torch.testing.assert_close(normed, expected[0], rtol=1e-6, atol=1e-6)
        halves, slots = (peers.epochs[:rows] & 1).long(), torch.arange(rows)
        for peer in set(range(world)) - {rank}:  # its row sent to every peer
            assert torch.equal(peers.data[peer][halves, rank, slots], partials[rank])
            assert _empty(peers.data[rank][halves, peer, slots])  # the peer's row taken
    assert peers.epochs[:4].tolist() == [3, 2, 2, 0]


def test_calls_go_on_when_the_epoch_counters_wrap() -> None:
    peers = _group(2, 1)
    peers.epochs[:2] = 2**31 - 2  # the next calls' epochs: 2**31 - 1, then -2**31, -2**31 + 1
    gen = torch.Generator().manual_seed(5)
    weight = torch.rand(HIDDEN, generator=gen) + 0.5
    for expected_epoch in (2**31 - 1, -(2**31), -(2**31) + 1):
        partials = [torch.randn(2, HIDDEN, generator=gen) for _ in range(2)]
        residual = torch.randn(2, HIDDEN, generator=gen)
        _peers_arrive(peers, partials)
        expected = all_reduce_add_rms_norm_reference(partials[1], residual, weight, EPS, peers)
        got = all_reduce_add_rms_norm(partials[1].clone(), residual.clone(), weight, EPS, peers)
        assert torch.equal(got[1], expected[1]) and torch.equal(got[1], sum(partials) + residual)
        assert peers.epochs[:2].tolist() == [expected_epoch] * 2
        assert _empty(peers.data[1][expected_epoch & 1, 0, :2])


def test_without_a_residual_the_sum_is_the_new_residual() -> None:
    """The model's first norm: the embedding's parts summed, normed, and the sum kept."""
    peers = _group(2, 1)
    gen = torch.Generator().manual_seed(7)
    weight = torch.rand(HIDDEN, generator=gen) + 0.5
    for rows in (3, 1):
        partials = [torch.randn(rows, HIDDEN, generator=gen) for _ in range(2)]
        _peers_arrive(peers, partials)
        expected = all_reduce_add_rms_norm_reference(partials[1], None, weight, EPS, peers)
        assert torch.equal(expected[1], partials[0] + partials[1])
        torch.testing.assert_close(expected[0], rms_norm_reference(expected[1], weight, EPS))
        normed, total = all_reduce_add_rms_norm(partials[1].clone(), None, weight, EPS, peers)
        assert torch.equal(total, expected[1])
        torch.testing.assert_close(normed, expected[0], rtol=1e-6, atol=1e-6)
    assert peers.epochs[:3].tolist() == [2, 1, 1]


def test_the_reference_matches_the_unfused_pair() -> None:
    peers = _group(2, 0)
    gen = torch.Generator().manual_seed(3)
    partials = [torch.randn(2, HIDDEN, generator=gen) for _ in range(2)]
    residual, weight = torch.randn(2, HIDDEN, generator=gen), torch.rand(HIDDEN, generator=gen)
    _peers_arrive(peers, partials)
    got = all_reduce_add_rms_norm_reference(partials[0], residual, weight, EPS, peers)
    want = fused_add_rms_norm_reference(partials[0] + partials[1], residual, weight, EPS)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_inputs_that_do_not_fit_the_buffers_are_refused() -> None:
    peers = _group(2, 0)
    weight = torch.ones(HIDDEN)
    for partial in (torch.zeros(MAX_ROWS + 1, HIDDEN), torch.zeros(1, HIDDEN + 8)):
        with pytest.raises(ValueError, match="do not fit the buffers"):
            all_reduce_add_rms_norm(partial, partial.clone(), weight, EPS, peers)
    with pytest.raises(ValueError, match="weight"):
        all_reduce_add_rms_norm(
            torch.zeros(1, HIDDEN), torch.zeros(1, HIDDEN), weight[:8], EPS, peers
        )
    with pytest.raises(ValueError, match="multiple of 8"):
        PeerBuffers.of(0, (torch.zeros(2, 1, 4, 12),), 1)


@pytest.mark.parametrize(
    ("dtype", "bits"), [(torch.float32, torch.int32), (torch.bfloat16, torch.int16)]
)
def test_a_negative_zero_is_sent_as_a_positive_one(dtype: torch.dtype, bits: torch.dtype) -> None:
    """-0.0 marks an empty slot: a row holding it must not look as if it never arrived."""
    peers = _group(2, 0, dtype=dtype)
    partials = [torch.ones(1, HIDDEN, dtype=dtype), torch.ones(1, HIDDEN, dtype=dtype)]
    partials[0][0, :3] = torch.tensor([-0.0, 0.0, -1.0])
    _peers_arrive(peers, partials)
    weight = torch.ones(HIDDEN, dtype=dtype)
    _, total = all_reduce_add_rms_norm(partials[0].clone(), None, weight, EPS, peers)
    sent = peers.data[1][1, 0, 0]
    assert torch.equal(sent, partials[0][0]) and sent[0].item() == 0.0
    assert sent.view(bits)[:2].tolist() == [0, 0]  # both +0.0
    assert total[0, :3].tolist() == [1.0, 1.0, 0.0]
