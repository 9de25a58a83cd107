"""Batched LoRA shrink and expand: the references against a per-token loop over the adapters,
and the Triton kernels against the references (under the interpreter on CPU, compiled on a
GPU), for decode-sized steps (a program per token) and prompt-sized ones (blocks of one
request's tokens through tl.dot, and blocks across requests token by token)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.lora import lora_expand_reference, lora_shrink_reference
from kernels.triton_lora import lora_expand, lora_shrink

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
# In bf16 the kernels round once, after the float32 sum; the references round each product.
CLOSE = dict(rtol=2e-2, atol=2e-2) if DEVICE == "cuda" else {}
PIECES = (64, 32, 32)  # a fused q/k/v
K, RANK, SLOTS = 64, 16, 3


def make_case(runs: list[tuple[int, int]], seed: int, dtype: torch.dtype = DTYPE):
    """Tokens in runs of (slot, count), as a step lays out its requests; -1: the base model."""
    generator = torch.Generator().manual_seed(seed)
    slots = torch.cat([torch.full((count,), slot, dtype=torch.int32) for slot, count in runs])
    x = torch.randn(len(slots), K, generator=generator)
    lora_a = torch.randn(SLOTS, len(PIECES), RANK, K, generator=generator) * 0.1
    lora_b = torch.randn(SLOTS, sum(PIECES), RANK, generator=generator) * 0.1
    out = torch.randn(len(slots), sum(PIECES), generator=generator)
    to = dict(device=DEVICE, dtype=dtype)
    return x.to(**to), lora_a.to(**to), lora_b.to(**to), slots.to(DEVICE), out.to(**to)


DECODE = [(0, 1), (-1, 1), (2, 1), (0, 1), (1, 1)]  # each token its own request
# Blocks of 16: of one slot, across requests, a partial one at the end
PROMPTS = [(1, 20), (-1, 7), (0, 33), (2, 16), (0, 1)]
# Blocks of 16: all without an adapter, then of one slot up to a partial tail
BASE_THEN_ONE = [(-1, 16), (1, 21)]


def test_the_references_are_a_per_token_loop_over_the_adapters() -> None:
    x, lora_a, lora_b, slots, out = make_case(DECODE, 0, torch.float64)
    shrunk = lora_shrink_reference(x, lora_a, slots)
    expanded = lora_expand_reference(out.clone(), shrunk, lora_b, slots, PIECES)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert not shrunk[:, t].any() and torch.equal(expanded[t], out[t])
            continue
        b = lora_b[slot]  # [N, R]
        start = 0
        for piece, size in enumerate(PIECES):
            y = lora_a[slot, piece] @ x[t]
            torch.testing.assert_close(shrunk[0, t, piece], y.float())
            want = out[t, start : start + size] + b[start : start + size] @ y
            torch.testing.assert_close(expanded[t, start : start + size], want)
            start += size


@pytest.mark.parametrize(
    ("runs", "block_t", "k_per_split"),
    [
        (DECODE, None, None),
        (DECODE, None, 16),
        (PROMPTS, None, None),
        (PROMPTS, 16, None),
        (PROMPTS, 16, 32),
        (BASE_THEN_ONE, 16, None),
    ],
    ids=[
        "decode", "decode-split-k", "prompts-by-token", "prompts-by-block",
        "prompts-by-block-split-k", "base-then-one",
    ],
)  # fmt: skip
def test_kernels_match_the_references(
    runs: list[tuple[int, int]], block_t: int | None, k_per_split: int | None
) -> None:
    x, lora_a, lora_b, slots, out = make_case(runs, 1)
    expected_shrunk = lora_shrink_reference(x, lora_a, slots)
    shrunk = lora_shrink(x, lora_a, slots, block_t=block_t, k_per_split=k_per_split)
    assert shrunk.shape[0] == (K // k_per_split if k_per_split else 1)
    torch.testing.assert_close(shrunk.sum(0, keepdim=True), expected_shrunk, **CLOSE)
    # The expand adds the partial sums up, whatever their number.
    expected = lora_expand_reference(out.clone(), expected_shrunk, lora_b, slots, PIECES)
    for partial in (expected_shrunk, shrunk):
        expanded = lora_expand(out.clone(), partial, lora_b, slots, PIECES, block_t=block_t)
        torch.testing.assert_close(expanded.float(), expected.float(), **CLOSE)


@pytest.mark.parametrize("block_t", [None, 16])
def test_a_slot_outside_the_slots_reads_as_no_adapter(block_t: int | None) -> None:
    # A padding row of a CUDA graph may hold any number: it must not read past the slots.
    x, lora_a, lora_b, slots, out = make_case(PROMPTS, 4)
    stale = slots.clone()
    stale[20:27] = SLOTS + 5  # the base-model run, given a slot that does not exist
    shrunk = lora_shrink(x, lora_a, stale, block_t=block_t)
    torch.testing.assert_close(shrunk.sum(0, keepdim=True), lora_shrink_reference(x, lora_a, slots))
    expanded = lora_expand(out.clone(), shrunk, lora_b, stale, PIECES, block_t=block_t)
    expected = lora_expand_reference(out.clone(), shrunk, lora_b, slots, PIECES)
    torch.testing.assert_close(expanded.float(), expected.float(), **CLOSE)


@pytest.mark.parametrize("order", ["grouped", "shuffled", "none"])
def test_blocks_take_the_tokens_in_any_order(order: str) -> None:
    """Decode-like: 45 tokens whose slots interleave. Grouped by slot (as the executor sorts
    them), a block holds one or two adapters; shuffled or as they come, up to four: the same
    result either way, each slot of a block multiplied once."""
    generator = torch.Generator().manual_seed(5)
    runs = [(int(s), 1) for s in torch.randint(-1, SLOTS, (45,), generator=generator)]
    x, lora_a, lora_b, slots, out = make_case(runs, 6)
    token_order = {
        "grouped": torch.sort(slots.cpu(), stable=True).indices,
        "shuffled": torch.randperm(45, generator=generator),
        "none": None,
    }[order]
    if token_order is not None:
        token_order = token_order.to(device=DEVICE, dtype=torch.int32)
    shrunk = lora_shrink(x, lora_a, slots, token_order, block_t=16, k_per_split=32)
    expected_shrunk = lora_shrink_reference(x, lora_a, slots)
    torch.testing.assert_close(shrunk.sum(0, keepdim=True), expected_shrunk, **CLOSE)
    expected = lora_expand_reference(out.clone(), expected_shrunk, lora_b, slots, PIECES)
    expanded = lora_expand(out.clone(), shrunk, lora_b, slots, PIECES, token_order, block_t=16)
    torch.testing.assert_close(expanded.float(), expected.float(), **CLOSE)


def test_one_piece_and_two() -> None:
    x, lora_a, lora_b, slots, out = make_case(PROMPTS, 2)
    for pieces in ((128,), (96, 32)):
        a = lora_a[:, : len(pieces)].contiguous()
        shrunk = lora_shrink(x, a, slots, block_t=16)
        expected = lora_expand_reference(out.clone(), shrunk, lora_b, slots, pieces)
        expanded = lora_expand(out.clone(), shrunk, lora_b, slots, pieces, block_t=16)
        torch.testing.assert_close(expanded.float(), expected.float(), **CLOSE)


def test_bad_inputs_are_refused() -> None:
    x, lora_a, lora_b, slots, out = make_case(DECODE, 3)
    with pytest.raises(ValueError, match="int32"):
        lora_shrink(x, lora_a, slots.long())
    with pytest.raises(ValueError, match="power-of-two rank"):
        lora_shrink(x, lora_a[:, :, :12].contiguous(), slots)
    with pytest.raises(ValueError, match="do not make"):
        lora_expand(out, torch.zeros(1, 5, 3, RANK, device=DEVICE), lora_b, slots, (64, 32, 31))
    with pytest.raises(ValueError, match="is not"):
        lora_expand(out, torch.zeros(1, 5, 2, RANK, device=DEVICE), lora_b, slots, PIECES)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens", [1, 8, 16, 17, 300, 700])
def test_gpu_real_shapes_match_the_references(num_tokens: int) -> None:
    # Llama-3.1-8B's q/k/v with rank-16 adapters in 8 slots; the tokens' slots interleave as
    # a decode step's do, and the kernels take them grouped by slot, as the executor sorts them.
    generator = torch.Generator().manual_seed(num_tokens)
    pieces, k = (4096, 1024, 1024), 4096
    slots = (torch.arange(num_tokens) % 9 - 1).to(torch.int32)  # -1 .. 7
    order = torch.sort(slots, stable=True).indices.to(torch.int32).cuda()
    slots = slots.cuda()
    x = torch.randn(num_tokens, k, generator=generator).cuda().bfloat16()
    lora_a = (torch.randn(8, 3, 16, k, generator=generator) * 0.02).cuda().bfloat16()
    lora_b = (torch.randn(8, sum(pieces), 16, generator=generator) * 0.02).cuda().bfloat16()
    out = torch.randn(num_tokens, sum(pieces), generator=generator).cuda().bfloat16()
    shrunk = lora_shrink(x, lora_a, slots, order)
    torch.testing.assert_close(
        shrunk.sum(0, keepdim=True), lora_shrink_reference(x, lora_a, slots), rtol=1e-2, atol=1e-2
    )
    expected = lora_expand_reference(out.clone(), shrunk, lora_b, slots, pieces)
    expanded = lora_expand(out.clone(), shrunk, lora_b, slots, pieces, order)
    torch.testing.assert_close(expanded.float(), expected.float(), rtol=2e-2, atol=2e-2)
