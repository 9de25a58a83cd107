"""The mixture of experts' grouped GEMMs (kernels/triton_moe.py) against the torch reference,
and the alignment they read: every (token, expert) pair once, in its expert's block. On the CPU
the kernels run under the Triton interpreter (tests/conftest.py), so shapes are small."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")

from kernels import triton_moe, triton_moe_align, triton_moe_gemv
from kernels.moe import (
    ClampedSwiglu,
    ExpertBiases,
    align_reference,
    moe_experts_reference,
    moe_route_reference,
    sum_chosen_reference,
)
from kernels.triton_moe import (
    moe_experts,
    moe_experts_grouped,
    sum_chosen,
    uses_gemv,
)
from kernels.triton_moe_align import align
from kernels.triton_moe_gemv import moe_experts_gemv
from kernels.triton_moe_route import moe_route
from kernels.triton_moe_tiles import (
    GROUPED_TILES,
    GROUPED_TILES_FP8,
    GemmTiles,
    GemvTiles,
    GroupedTiles,
    grouped_tiles,
)
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
    """Under the interpreter the down GEMV takes 16 times the default tile's columns (the same
    K a step): its cost is by program."""
    if DEVICE == "cpu":
        gemv = functools.partial(moe_experts_gemv, tiles=GemvTiles(down_n=64))
        monkeypatch.setattr(triton_moe, "moe_experts_gemv", gemv)


def assert_kernel_close(out: torch.Tensor, expected: torch.Tensor, fp8: bool = False) -> None:
    """Interpreted, the kernels sum in float32 as the reference does: close to 2e-3. On a GPU
    the tensor cores sum in another order: close to 1 % of the output's range. With `fp8`
    experts that order can also move an input that is rounded to e4m3 next by one step (an
    eighth of it): one element in a thousand may then be off by up to 10 % of the range
    (seen at 0.06: one of 10,240, at the FP8 table's last tiles)."""
    assert (out.shape, out.dtype) == (expected.shape, expected.dtype)
    if not out.is_cuda:
        torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)
        return
    scale = float(expected.abs().max())
    if not fp8:
        torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2 * scale)
        return
    error = (out.float() - expected.float()).abs()
    outside = error > 1e-2 * scale + 1e-2 * expected.float().abs()
    assert int(outside.sum()) <= max(1, out.numel() // 1000), f"{int(outside.sum())} far off"
    assert float(error.max()) <= 0.1 * scale, f"max error {float(error.max())} of {scale}"


def routed(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=generator)
    logits[:, 0] -= 100.0  # expert 0 is never chosen: an empty group
    weights, ids = moe_route_reference(logits.to(DEVICE), top_k, renormalize=True)
    return weights, ids


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "one_program"),
    [
        (1, 4, 2, True),
        (9, 6, 3, True),
        (40, 8, 2, True),
        (64, 128, 8, True),
        (1, 4, 2, False),  # more slots than pairs
        (1, 128, 8, False),  # 121 blocks, 8 pairs: place kernel programs past the pairs
        (40, 8, 2, False),
        (70, 60, 4, False),  # E not a power of two
        (600, 128, 8, False),  # 4,800 pairs: 75 chunks, two steps of the scan
    ],
)
def test_align_puts_each_pair_once_in_its_experts_block(
    tokens: int, experts: int, top_k: int, one_program: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, ids = routed(tokens, experts, top_k, seed=tokens)
    num_pairs = tokens * top_k
    bound = num_pairs if one_program else 0  # either kernel takes any count
    monkeypatch.setattr(triton_moe_align, "ONE_PROGRAM_MAX_PAIRS", bound)
    block_m = 16
    sorted_pairs, block_experts = align(ids, experts, block_m)
    pairs = sorted_pairs.cpu().view(-1, block_m)
    owners = block_experts.cpu()
    seen = []
    for block, expert in enumerate(owners.tolist()):
        real = [p for p in pairs[block].tolist() if p < num_pairs]
        if expert < 0:
            assert not real
        assert all(ids.flatten()[p].item() == expert for p in real)
        seen += real
    assert sorted(seen) == list(range(num_pairs))
    assert owners[owners >= 0].diff().ge(0).all()  # groups in expert order
    # Both kernels lay the pairs out as the reference does (no atomics: the same every run).
    in_torch = align_reference(ids, experts, block_m)
    assert torch.equal(sorted_pairs, in_torch[0]) and torch.equal(block_experts, in_torch[1])


@pytest.mark.parametrize("one_program", [True, False])
def test_align_leaves_out_another_ranks_pairs(
    one_program: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, experts, top_k, block_m = 40, 8, 2, 16
    _, ids = routed(tokens, experts, top_k, seed=5)
    ids = another_ranks(ids)
    monkeypatch.setattr(triton_moe_align, "ONE_PROGRAM_MAX_PAIRS", 80 if one_program else 0)
    sorted_pairs, block_experts = align(ids, experts, block_m)
    placed = sorted(p for p in sorted_pairs.tolist() if p < tokens * top_k)
    assert placed == [p for p, e in enumerate(ids.flatten().tolist()) if e >= 0]
    in_torch = align_reference(ids, experts, block_m)
    assert torch.equal(sorted_pairs, in_torch[0]) and torch.equal(block_experts, in_torch[1])


def test_the_chosen_rows_sum_leaves_the_others_unread() -> None:
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(5 * 3, 40, generator=generator).to(DEVICE, torch.bfloat16)
    ids = torch.tensor([[0, -1, 2], [-1, -1, -1], [1, 1, 0], [-1, 4, -1], [3, 2, 1]], device=DEVICE)
    rows[(ids < 0).flatten()] = float("nan")
    out = sum_chosen(rows, ids)
    expected = sum_chosen_reference(rows, ids)
    assert expected[1].eq(0).all() and not expected.isnan().any()
    torch.testing.assert_close(out, expected)
    every = torch.zeros_like(ids)  # every choice made here: each token's three rows
    torch.testing.assert_close(sum_chosen(rows.nan_to_num(0.0), every),
                               rows.nan_to_num(0.0).view(5, 3, 40).sum(dim=1))  # fmt: skip


@pytest.mark.parametrize(
    ("tokens", "experts", "groups", "gpt_oss"),
    [
        (2, 64, 0, False),  # the GEMVs; token 0's choices all another rank's
        (1, 32, 1, True),  # FP8 GEMVs, a scale a row, gpt-oss's biases (each pair's once)
        (2, 64, 2, False),  # FP8 GEMVs, a scale a row and group
        (9, 6, 0, True),  # the grouped GEMMs
        (9, 6, 1, False),
        (9, 6, 2, False),
    ],
)
def test_another_ranks_pairs_add_nothing(
    tokens: int, experts: int, groups: int, gpt_oss: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expert parallelism: a choice of expert -1 (another rank's) adds nothing, in the GEMVs
    and the grouped GEMMs (told `partial`), and reads nothing: expert 0, which no token
    chooses, holds NaN, and every torch.empty buffer starts as NaN. The reference skips such
    a choice as one of weight 0."""
    nan_empty(monkeypatch)
    hidden, inter, top_k = 256, 128, 4
    generator = torch.Generator().manual_seed(tokens + experts + groups)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=generator) / 8
    down = torch.randn(experts, hidden, inter, generator=generator) / 8
    scales: tuple[torch.Tensor | None, ...] = (None, None)
    if groups:
        scales = (torch.full((experts, 2 * inter, groups), 1 / 64, device=DEVICE),
                  torch.full((experts, hidden, groups), 1 / 64, device=DEVICE))  # fmt: skip
        gate_up, down = (gate_up * 64).to(torch.float8_e4m3fn), (down * 64).to(torch.float8_e4m3fn)
    gate_up, down = gate_up.to(DEVICE), down.to(DEVICE)
    extra: dict = {}
    if gpt_oss:
        extra = dict(swiglu=ClampedSwiglu(limit=2.0), biases=ExpertBiases(
            torch.randn(experts, 2 * inter, generator=generator).to(DEVICE),
            torch.randn(experts, hidden, generator=generator).to(DEVICE),
        ))  # fmt: skip
    weights, ids = routed(tokens, experts, top_k, seed=tokens)
    ids = another_ranks(ids)
    expected = moe_experts_reference(x, gate_up, down, weights, ids, *scales, **extra)
    as_weight_0 = moe_experts_reference(
        x, gate_up, down, torch.where(ids < 0, 0.0, weights), ids.clamp(min=0), *scales, **extra
    )
    torch.testing.assert_close(expected, as_weight_0)
    # Expert 0, where a kernel would read for expert -1, holds NaN for the kernels.
    gate_up, down = nan_expert_0(gate_up), nan_expert_0(down)
    scales = tuple(None if s is None else nan_expert_0(s) for s in scales)
    if gpt_oss:
        extra["biases"] = ExpertBiases(*(nan_expert_0(b) for b in extra["biases"]))
    out = moe_experts(x, gate_up, down, weights, ids, *scales, **extra)
    assert_kernel_close(out, expected, fp8=scales[0] is not None)
    assert uses_gemv(tokens * top_k, experts, fp8=groups == 1) == (experts >= 16)


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renormalize"),
    [(1, 128, 8, True), (5, 60, 4, False), (3, 8, 2, True), (2, 6, 6, False)],
)
def test_routing_in_one_launch_matches_the_reference(
    tokens: int, experts: int, top_k: int, renormalize: bool
) -> None:
    generator = torch.Generator().manual_seed(experts)
    logits = torch.randn(tokens, experts, generator=generator).to(torch.bfloat16).to(DEVICE)
    weights, ids = moe_route(logits, top_k, renormalize)
    expected_weights, expected_ids = moe_route_reference(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    # bf16 logits tie now and then: the same experts, by weight, whatever the order of a tie
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)
    assert torch.equal(ids.sort(dim=-1).values, expected_ids.sort(dim=-1).values)


def test_routing_a_row_of_nan_or_inf_still_picks_k_distinct_real_experts() -> None:
    """A broken row (dummy weights overflow) must not send a kernel past the experts."""
    logits = torch.full((3, 6), float("nan"), device=DEVICE)
    logits[1] = -float("inf")
    logits[2, 4] = float("inf")
    _, ids = moe_route(logits, 4, renormalize=True)
    for row in ids.cpu().tolist():
        assert len(set(row)) == 4 and all(0 <= expert < 6 for expert in row)
    assert ids[2, 0].item() == 4


def test_routing_refuses_more_choices_than_experts() -> None:
    with pytest.raises(ValueError, match="top_k"):
        moe_route(torch.zeros(1, 4, device=DEVICE), 5, renormalize=True)


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k"),
    [
        (1, 32, 48, 4, 2),
        (7, 64, 80, 6, 3),
        (520, 32, 16, 5, 2),  # blocks of 32 pairs
        (1, 96, 40, 16, 4),  # few pairs against the experts: the GEMV kernels
        (2, 300, 24, 64, 8),  # GEMV, K past one step of the loop and not a multiple of it
    ],
)
def test_expert_gemms_match_the_reference(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int
) -> None:
    generator = torch.Generator().manual_seed(hidden + tokens)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=generator) / 8).to(DEVICE)
    down = (torch.randn(experts, hidden, inter, generator=generator) / 8).to(DEVICE)
    weights, ids = routed(tokens, experts, top_k, seed=tokens)
    assert uses_gemv(tokens * top_k, experts) == (experts >= 16)
    out = moe_experts(x, gate_up, down, weights, ids)
    expected = moe_experts_reference(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("most_pairs", [most for most, _ in GROUPED_TILES])
def test_grouped_gemms_match_the_reference_at_every_tile_set(most_pairs: int) -> None:
    tiles = grouped_tiles(most_pairs)
    generator = torch.Generator().manual_seed(tiles.block_m)
    tokens, hidden, inter, experts, top_k = 40, 96, 80, 6, 2
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=generator) / 8).to(DEVICE)
    down = (torch.randn(experts, hidden, inter, generator=generator) / 8).to(DEVICE)
    weights, ids = routed(tokens, experts, top_k, seed=tiles.block_m)
    out = moe_experts_grouped(x, gate_up, down, weights, ids, tiles)
    assert_kernel_close(out, moe_experts_reference(x, gate_up, down, weights, ids))


@pytest.mark.parametrize("swap_ab", [False, True], ids=["x-first", "weights-first"])
@pytest.mark.parametrize("group_m", [1, 3, 1 << 16])
def test_grouped_gemms_cover_every_block_and_tile_in_any_program_order(
    group_m: int, swap_ab: bool
) -> None:
    """Programs take group_m blocks at a time (kernels/triton_moe.block_tile): one at a time,
    groups of 3 with a short last group, or every block at once; three column tiles a GEMM,
    the last partial; each step's product as it is or transposed (tile_product)."""
    gemm = GemmTiles(32, 32, 4, 2, group_m, swap_ab)
    tiles = GroupedTiles(16, gemm, gemm)
    generator = torch.Generator().manual_seed(group_m)
    tokens, hidden, inter, experts, top_k = 40, 88, 80, 6, 2
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=generator) / 8).to(DEVICE)
    down = (torch.randn(experts, hidden, inter, generator=generator) / 8).to(DEVICE)
    weights, ids = routed(tokens, experts, top_k, seed=group_m)
    out = moe_experts_grouped(x, gate_up, down, weights, ids, tiles)
    assert_kernel_close(out, moe_experts_reference(x, gate_up, down, weights, ids))


@pytest.mark.parametrize("most_pairs", [most for most, _ in GROUPED_TILES_FP8])
def test_fp8_grouped_gemms_match_the_reference_at_every_tile_set(most_pairs: int) -> None:
    """FP8 experts' own tiles (kernels/triton_moe_tiles.py `GROUPED_TILES_FP8`), a scale a
    row."""
    tiles = grouped_tiles(most_pairs, fp8=True)
    generator = torch.Generator().manual_seed(most_pairs % 97)
    tokens, hidden, inter, experts, top_k = 40, 256, 128, 6, 2
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)

    def fp8(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = (torch.randn(experts, rows, cols, generator=generator) * 64).to(torch.float8_e4m3fn)
        return q.to(DEVICE), (torch.rand(experts, rows, 1, generator=generator) / 256).to(DEVICE)

    (gate_up, gate_up_scale), (down, down_scale) = fp8(2 * inter, hidden), fp8(hidden, inter)
    weights, ids = routed(tokens, experts, top_k, seed=tiles.block_m)
    out = moe_experts_grouped(x, gate_up, down, weights, ids, tiles, gate_up_scale, down_scale)
    expected = moe_experts_reference(x, gate_up, down, weights, ids, gate_up_scale, down_scale)
    assert_kernel_close(out, expected, fp8=True)


@pytest.mark.parametrize("groups", [1, 2], ids=["rows", "groups"])
def test_fp8_grouped_gemms_weights_first_match_the_reference(groups: int) -> None:
    """The transposed products (swap_ab) of FP8 experts: the scales of a row (applied after the
    loop) and of a group (at each step) land on the right rows and columns."""
    tokens, hidden, inter, experts, top_k = 24, 256, 128, 5, 2
    generator = torch.Generator().manual_seed(groups)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)

    def fp8(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = (torch.randn(experts, rows, cols, generator=generator) * 64).to(torch.float8_e4m3fn)
        scale = torch.rand(experts, rows, groups, generator=generator) / 256 + 1e-3
        return q.to(DEVICE), scale.to(DEVICE)

    (gate_up, gate_up_scale), (down, down_scale) = fp8(2 * inter, hidden), fp8(hidden, inter)
    gemm = GemmTiles(64, 64, 4, 2, 2, swap_ab=True)
    weights, ids = routed(tokens, experts, top_k, seed=groups)
    out = moe_experts_grouped(
        x, gate_up, down, weights, ids, GroupedTiles(16, gemm, gemm), gate_up_scale, down_scale
    )
    expected = moe_experts_reference(x, gate_up, down, weights, ids, gate_up_scale, down_scale)
    assert_kernel_close(out, expected, fp8=True)


@pytest.mark.parametrize(
    ("tokens", "experts", "groups"),
    [
        (1, 16, 1),  # GEMV, a scale per row
        (2, 64, 4),  # GEMV, a scale per row and group of columns
        (7, 6, 1),  # grouped GEMMs
        (9, 6, 2),
    ],
)
def test_fp8_experts_match_the_reference(tokens: int, experts: int, groups: int) -> None:
    """FP8 experts (e4m3 with float32 scales per row, or per row and group), W8A8: the
    kernels against the reference, which rounds each input as the weights are scaled."""
    hidden, inter, top_k = 256, 128, 2
    generator = torch.Generator().manual_seed(tokens + groups)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)

    def fp8(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = (torch.randn(experts, rows, cols, generator=generator) * 64).to(torch.float8_e4m3fn)
        scale = torch.rand(experts, rows, groups, generator=generator) / 256 + 1e-3
        return q.to(DEVICE), scale.to(DEVICE)

    gate_up, gate_up_scale = fp8(2 * inter, hidden)
    down, down_scale = fp8(hidden, inter)
    weights, ids = routed(tokens, experts, top_k, seed=tokens)
    out = moe_experts(x, gate_up, down, weights, ids, gate_up_scale, down_scale)
    expected = moe_experts_reference(x, gate_up, down, weights, ids, gate_up_scale, down_scale)
    assert_kernel_close(out, expected, fp8=True)
    assert uses_gemv(tokens * top_k, experts, fp8=groups == 1) == (experts >= 16)


def test_expert_parallel_ranks_weigh_pairs_against_every_ranks_experts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank of four holds 32 of 128 experts: 2 tokens' 16 pairs are few against the 128
    (the GEMVs), though not against its own 32; the result is the same either way."""
    chosen = record_calls(monkeypatch, triton_moe, "moe_experts_gemv", "moe_experts_grouped")
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(2, 64, generator=generator).to(DEVICE)
    gate_up = (torch.randn(32, 64, 64, generator=generator) / 8).to(DEVICE)
    down = (torch.randn(32, 64, 32, generator=generator) / 8).to(DEVICE)
    weights, ids = routed(2, 128, 8, seed=5)
    local = first_experts(ids, 32)
    outs = [moe_experts(x, gate_up, down, weights, local, all_experts=n) for n in (128, None)]
    assert chosen == ["moe_experts_gemv", "moe_experts_grouped"]
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-3, atol=2e-3)


def test_fp8_experts_take_the_gemvs_for_half_as_many_pairs() -> None:
    """Qwen3-30B-A3B's 128 experts, top 8: bf16 experts take the GEMVs up to 4 tokens, FP8
    experts up to 2, where the grouped GEMMs were as fast or faster past that."""
    assert [uses_gemv(8 * tokens, 128) for tokens in (1, 2, 4, 5)] == [True, True, True, False]
    assert [uses_gemv(8 * tokens, 128, fp8=True) for tokens in (1, 2, 3)] == [True, True, False]


@pytest.mark.parametrize("scale_load", [64, 8192], ids=["a-few-columns-a-load", "whole-rows"])
def test_fp8_gemvs_scale_their_input_rows_however_many_columns_a_load_takes(
    monkeypatch: pytest.MonkeyPatch, scale_load: int
) -> None:
    """The FP8 GEMVs find their input rows' e4m3 scales (the token's for gate/up, its k hidden
    rows' for down) from loads of many columns of every row at once; with k = 3 (a masked
    fourth row) and loads of a few columns (several a row) too."""
    monkeypatch.setattr(triton_moe_gemv, "SCALE_LOAD", scale_load)
    experts, hidden, inter, top_k = 32, 256, 128, 3
    generator = torch.Generator().manual_seed(scale_load)
    x = torch.randn(2, hidden, generator=generator).to(DEVICE)

    def fp8(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = (torch.randn(experts, rows, cols, generator=generator) * 64).to(torch.float8_e4m3fn)
        scale = torch.rand(experts, rows, 1, generator=generator) / 256 + 1e-3
        return q.to(DEVICE), scale.to(DEVICE)

    (gate_up, gate_up_scale), (down, down_scale) = fp8(2 * inter, hidden), fp8(hidden, inter)
    weights, ids = routed(2, experts, top_k, seed=5)
    out = moe_experts_gemv(x, gate_up, down, weights, ids, None, gate_up_scale, down_scale)
    expected = moe_experts_reference(x, gate_up, down, weights, ids, gate_up_scale, down_scale)
    assert_kernel_close(out, expected, fp8=True)


def test_the_fp8_reference_rounds_inputs_and_dequantizes_weights() -> None:
    """One token, one expert: down(silu(gate x') * up x')' with x' the token rounded to e4m3
    by its amax, and the weights q * scale."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, 64, generator=generator)
    gate_up = (torch.randn(1, 32, 64, generator=generator) * 64).to(torch.float8_e4m3fn)
    down = (torch.randn(1, 64, 16, generator=generator) * 64).to(torch.float8_e4m3fn)
    gu_scale, d_scale = torch.full((1, 32, 1), 0.01), torch.full((1, 64, 1), 0.02)
    out = moe_experts_reference(
        x, gate_up, down, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long), gu_scale, d_scale
    )

    def rounded(v: torch.Tensor) -> torch.Tensor:
        scale = v.abs().max() / 448
        return (v / scale).to(torch.float8_e4m3fn).float() * scale

    projected = rounded(x) @ (gate_up[0].float() * 0.01).T
    hidden = torch.nn.functional.silu(projected[:, :16]) * projected[:, 16:]
    expected = rounded(hidden) @ (down[0].float() * 0.02).T
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_routing_counts_each_real_tokens_choices() -> None:
    """The experts' load: each token's k choices added to `counts`, padding rows (a KV slot
    below 0) left out, as the reference counts them."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 16, generator=generator).to(DEVICE)
    slots = torch.tensor([5, 6, -1, 7, -1, 9], device=DEVICE)
    counts = torch.full((16,), 10, dtype=torch.int64, device=DEVICE)
    _, ids = moe_route(logits, 3, True, counts, slots)
    expected = torch.full((16,), 10, dtype=torch.int64, device=DEVICE)
    moe_route_reference(logits, 3, True, expected, slots)
    assert torch.equal(counts, expected)
    assert int(counts.sum()) == 10 * 16 + 4 * 3
    real_ids = ids[slots >= 0].flatten().cpu()
    assert torch.equal(counts.cpu() - 10, torch.bincount(real_ids, minlength=16))


@pytest.mark.parametrize(("tokens", "experts"), [(1, 16), (9, 6)], ids=["gemv", "grouped"])
@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_gpt_oss_experts_match_the_reference(tokens: int, experts: int, fp8: bool) -> None:
    """gpt-oss's experts: each projection's bias, the clamped SwiGLU (a limit the sums reach:
    both clamps bite), in the GEMVs and the grouped GEMMs, float and FP8 weights."""
    hidden, inter, top_k = 256, 128, 2
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=generator) / 4
    down = torch.randn(experts, hidden, inter, generator=generator) / 8
    scales: tuple[torch.Tensor, ...] = (None, None)  # type: ignore[assignment]
    if fp8:
        scales = (
            torch.full((experts, 2 * inter, 1), 1 / 64),
            torch.full((experts, hidden, 1), 1 / 64),
        )
        gate_up, down = (gate_up * 64).to(torch.float8_e4m3fn), (down * 64).to(torch.float8_e4m3fn)
    gate_up, down = gate_up.to(DEVICE), down.to(DEVICE)
    scales = tuple(s.to(DEVICE) if s is not None else None for s in scales)
    biases = ExpertBiases(
        torch.randn(experts, 2 * inter, generator=generator).to(DEVICE),
        torch.randn(experts, hidden, generator=generator).to(DEVICE),
    )
    swiglu = ClampedSwiglu(limit=2.0)
    weights, ids = routed(tokens, experts, top_k, seed=tokens)
    out = moe_experts(x, gate_up, down, weights, ids, *scales, biases, swiglu)
    expected = moe_experts_reference(x, gate_up, down, weights, ids, *scales, biases, swiglu)
    assert not torch.allclose(
        expected, moe_experts_reference(x, gate_up, down, weights, ids, *scales)
    )
    assert_kernel_close(out, expected, fp8=scales[0] is not None)
