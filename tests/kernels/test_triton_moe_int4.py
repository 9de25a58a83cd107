"""int4 experts (kernels/triton_moe_int4.py, and its GEMVs for a decode's few pairs) against the
torch reference: groups of a step and more (the grouped GEMMs' fast path), groups of 32
(weights dequantized one by one), one scale a row, symmetric and with zero points. On the CPU
under the Triton interpreter (small shapes)."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")

from kernels import triton_moe_int4
from kernels.int4 import Int4Stack, dequantize_int4_stack, quantize_int4_reference
from kernels.moe import moe_experts_int4_reference, moe_experts_reference, moe_route_reference
from kernels.triton_moe_int4 import moe_experts_int4, moe_experts_int4_grouped
from kernels.triton_moe_int4_gemv import Int4GemvTiles, moe_experts_int4_gemv, uses_int4_gemv
from kernels.triton_moe_tiles import GemmTiles, GroupedTiles
from tests.kernels.expert_parallel import (
    another_ranks,
    first_experts,
    nan_empty,
    nan_expert_0,
    record_calls,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def interpreted_gemv_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter the GEMVs take 8 and 16 times the default tiles' rows (the same
    words a step, so the same masking past K): its cost is by program, 15 s against 1.7 here
    for the same sums."""
    if DEVICE == "cpu":
        tiles = Int4GemvTiles(gate_up_n=32, down_n=64)
        gemv = functools.partial(moe_experts_int4_gemv, tiles=tiles)
        monkeypatch.setattr(triton_moe_int4, "moe_experts_int4_gemv", gemv)


def int4_stack(experts: int, rows: int, cols: int, group: int, symmetric: bool,
               generator: torch.Generator) -> Int4Stack:  # fmt: skip
    """Random float experts rounded to int4 per group of `group` columns."""
    parts = [
        quantize_int4_reference(torch.randn(rows, cols, generator=generator), group, symmetric)
        for _ in range(experts)
    ]
    qweight = torch.stack([part[0] for part in parts]).to(DEVICE)
    scales = torch.stack([part[1] for part in parts]).to(DEVICE) / 8
    zeros = None if symmetric else torch.stack([part[2] for part in parts]).to(DEVICE)  # type: ignore[misc]
    return Int4Stack(qweight, scales, zeros, group)


def routed(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=generator)
    logits[:, 0] -= 100.0  # expert 0 is never chosen: an empty group
    return moe_route_reference(logits.to(DEVICE), top_k, renormalize=True)


@pytest.mark.parametrize(
    ("tokens", "experts", "group", "symmetric"),
    [
        (1, 32, 128, True),  # one token's pairs: the GEMVs
        (2, 64, 32, False),  # GEMVs, groups of 32, zero points
        (7, 6, 128, False),  # grouped GEMMs; a step a group, zero points
        (9, 6, 32, False),  # groups of 32: four a step, weights dequantized one by one
        (40, 8, 0, True),  # one scale a row (a group spans K)
        (520, 5, 64, False),  # blocks of 32 pairs; steps of 64 columns
    ],
)
def test_int4_experts_match_the_reference(
    tokens: int, experts: int, group: int, symmetric: bool
) -> None:
    hidden, inter, top_k = 256, 128, 2
    generator = torch.Generator().manual_seed(tokens + group)
    gate_up = int4_stack(experts, 2 * inter, hidden, group or hidden, symmetric, generator)
    down = int4_stack(experts, hidden, inter, group or inter, symmetric, generator)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    weights, ids = routed(tokens, experts, top_k, seed=tokens)
    out = moe_experts_int4(x, gate_up, down, weights, ids)
    expected = moe_experts_int4_reference(x, gate_up, down, weights, ids)
    assert uses_int4_gemv(tokens * top_k, experts) == (experts >= 32)
    if uses_int4_gemv(tokens * top_k, experts):  # the grouped GEMMs take any pair count too
        grouped = moe_experts_int4_grouped(x, gate_up, down, weights, ids)
        torch.testing.assert_close(grouped, out, rtol=1e-3, atol=1e-2 * float(out.abs().max()))
    scale = float(expected.abs().max())  # float32 dots in full precision on the GPU too
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.parametrize(("tokens", "experts"), [(2, 64), (7, 6)], ids=["gemv", "grouped"])
def test_another_ranks_int4_pairs_add_nothing(
    tokens: int, experts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expert parallelism: a choice of expert -1 (another rank's) adds nothing and reads
    nothing, in the GEMVs and the grouped GEMMs (told `partial`): expert 0, which no token
    chooses, has NaN scales, and every torch.empty buffer starts as NaN
    (tests/kernels/expert_parallel.py)."""
    nan_empty(monkeypatch)
    hidden, inter, top_k = 256, 128, 2
    generator = torch.Generator().manual_seed(tokens)
    gate_up = int4_stack(experts, 2 * inter, hidden, 128, False, generator)
    down = int4_stack(experts, hidden, inter, 128, False, generator)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    weights, ids = routed(tokens, experts, top_k, seed=tokens)
    ids = another_ranks(ids)
    expected = moe_experts_int4_reference(x, gate_up, down, weights, ids)
    gate_up, down = (s._replace(scales=nan_expert_0(s.scales)) for s in (gate_up, down))
    out = moe_experts_int4(x, gate_up, down, weights, ids)
    assert uses_int4_gemv(tokens * top_k, experts) == (experts >= 32)
    scale = float(expected.abs().max())
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.skipif(DEVICE == "cpu", reason="16-bit tensor-core dots: on the GPU")
@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_int4_experts_in_bf16_at_a_qwen3_moe_layers_shape(tokens: int) -> None:
    """Qwen3-30B-A3B's experts (128 of 768 columns over 2048, top 8), groups of 128."""
    hidden, inter, experts, top_k = 2048, 768, 128, 8
    generator = torch.Generator().manual_seed(tokens)
    gate_up = int4_stack(experts, 2 * inter, hidden, 128, False, generator)
    down = int4_stack(experts, hidden, inter, 128, False, generator)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE, torch.bfloat16)
    weights, ids = routed(tokens, experts, top_k, seed=tokens)
    out = moe_experts_int4(x, gate_up, down, weights, ids)
    expected = moe_experts_int4_reference(x, gate_up, down, weights, ids)
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2 * scale)


def test_expert_parallel_ranks_count_their_share_of_the_pairs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank of four holds 16 of 64 experts: one token's 4 pairs are about one of its own,
    few against its 16 (the GEMVs), though 4 * 16 is not (the grouped GEMMs without
    all_experts); the result is the same either way."""
    names = ("moe_experts_int4_gemv", "moe_experts_int4_grouped")
    chosen = record_calls(monkeypatch, triton_moe_int4, *names)
    generator = torch.Generator().manual_seed(6)
    gate_up = int4_stack(16, 64, 128, 128, True, generator)
    down = int4_stack(16, 128, 32, 32, True, generator)
    x = torch.randn(1, 128, generator=generator).to(DEVICE)
    weights, ids = routed(1, 64, 4, seed=6)
    local = first_experts(ids, 16)
    outs = [moe_experts_int4(x, gate_up, down, weights, local, all_experts=n) for n in (64, None)]
    assert chosen == list(names)
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-3, atol=2e-3)


def test_the_int4_reference_is_the_float_reference_on_the_dequantized_weights() -> None:
    """What W4A16 means here: each weight (q - z) * scale rounded to x's dtype first."""
    generator = torch.Generator().manual_seed(5)
    gate_up = int4_stack(3, 64, 64, 32, False, generator)
    down = int4_stack(3, 64, 32, 32, False, generator)
    x = torch.randn(4, 64, generator=generator).to(DEVICE, torch.bfloat16)
    weights, ids = routed(4, 3, 2, seed=5)
    w1 = dequantize_int4_stack(gate_up, torch.bfloat16)
    assert w1.dtype == torch.bfloat16 and w1.shape == (3, 64, 64)
    # Expert 1's row 5, column 9, by hand: in a chunk of 32 columns, column 8p + 2c + h sits
    # in word c at nibble 2p + h (kernels/int4.py), so column 9 in word 0 at nibble 3.
    value = (int(gate_up.qweight[1, 5, 0]) >> (4 * 3)) & 0xF
    zero = float(gate_up.zeros[1, 5, 0]) if gate_up.zeros is not None else 8.0
    by_hand = (value - zero) * float(gate_up.scales[1, 5, 0])
    assert float(w1[1, 5, 9]) == float(torch.tensor(by_hand).to(torch.bfloat16))
    out = moe_experts_int4_reference(x, gate_up, down, weights, ids)
    expected = moe_experts_reference(x, w1, dequantize_int4_stack(down, x.dtype), weights, ids)
    assert torch.equal(out, expected)


def test_int4_experts_refuse_what_they_cannot_read() -> None:
    generator = torch.Generator().manual_seed(0)
    gate_up = int4_stack(2, 64, 64, 32, True, generator)
    down = int4_stack(2, 64, 32, 32, True, generator)
    weights, ids = routed(1, 2, 1, seed=0)
    with pytest.raises(ValueError, match="qweight"):
        moe_experts_int4(torch.randn(1, 96, device=DEVICE), gate_up, down, weights, ids)
    wrong = Int4Stack(down.qweight, down.scales[:, :, :0], None, 32)
    with pytest.raises(ValueError, match="scales"):
        moe_experts_int4(torch.randn(1, 64, device=DEVICE), gate_up, wrong, weights, ids)


@pytest.mark.parametrize("hidden", [96, 32])
def test_a_k_past_the_last_whole_step_is_masked(
    hidden: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of 64 columns over a K of 96 or 32 (whole chunks of 32, as a rank's 1,440 of
    gpt-oss's experts on the GPU, whose tl.dot takes no smaller step): the last step's columns
    past K count for nothing. Forced on the CPU, where steps of 32 would divide K."""
    monkeypatch.setattr(triton_moe_int4, "_step_columns", lambda *_: 64)
    generator = torch.Generator().manual_seed(hidden)
    gate_up = int4_stack(3, 64, hidden, 32, False, generator)
    down = int4_stack(3, hidden, 32, 32, False, generator)
    x = torch.randn(5, hidden, generator=generator).to(DEVICE)
    weights, ids = routed(5, 3, 2, seed=hidden)
    tiles = GroupedTiles(16, GemmTiles(64, 128, 4, 3), GemmTiles(64, 128, 4, 3))
    out = moe_experts_int4_grouped(x, gate_up, down, weights, ids, tiles)
    expected = moe_experts_int4_reference(x, gate_up, down, weights, ids)
    scale = float(expected.abs().max())
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-4 * scale)


def test_transposed_products_are_refused_by_name() -> None:
    """The int4 GEMMs multiply weights first already: a tile set asking for swap_ab is an error,
    not a flag passed over."""
    generator = torch.Generator().manual_seed(0)
    gate_up = int4_stack(3, 64, 64, 32, False, generator)
    down = int4_stack(3, 64, 32, 32, False, generator)
    weights, ids = routed(5, 3, 2, seed=0)
    swapped = GemmTiles(64, 128, 4, 3, swap_ab=True)
    tiles = GroupedTiles(16, swapped, swapped)
    with pytest.raises(ValueError, match="swap_ab"):
        moe_experts_int4_grouped(torch.randn(5, 64).to(DEVICE), gate_up, down, weights, ids, tiles)
