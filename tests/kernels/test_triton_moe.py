"""The mixture of experts' grouped GEMMs (kernels/triton_moe.py) against the torch reference,
and the alignment they read: every (token, expert) pair once, in its expert's block. On the CPU
the kernels run under the Triton interpreter (tests/conftest.py), so shapes are small."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.moe import moe_experts_reference, moe_route_reference
from kernels.triton_moe import align, block_rows, moe_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routed(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=generator)
    logits[:, 0] -= 100.0  # expert 0 is never chosen: an empty group
    weights, ids = moe_route_reference(logits.to(DEVICE), top_k, renormalize=True)
    return weights, ids


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 4, 2), (9, 6, 3), (40, 8, 2)])
def test_align_puts_each_pair_once_in_its_experts_block(tokens: int, experts: int, top_k: int):
    _, ids = routed(tokens, experts, top_k, seed=tokens)
    block_m = 16
    sorted_pairs, block_experts = align(ids, experts, block_m)
    num_pairs = tokens * top_k
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


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k"),
    [(1, 32, 48, 4, 2), (7, 64, 80, 6, 3), (520, 32, 16, 5, 2)],  # the last: 64-pair blocks
)
def test_grouped_gemms_match_the_reference(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int
) -> None:
    generator = torch.Generator().manual_seed(hidden + tokens)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=generator) / 8).to(DEVICE)
    down = (torch.randn(experts, hidden, inter, generator=generator) / 8).to(DEVICE)
    weights, ids = routed(tokens, experts, top_k, seed=tokens)
    assert block_rows(tokens * top_k) == (64 if tokens * top_k > 1024 else 16)
    out = moe_experts(x, gate_up, down, weights, ids)
    expected = moe_experts_reference(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)
