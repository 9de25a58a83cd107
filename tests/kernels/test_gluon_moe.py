"""The Gluon grouped GEMMs of a mixture of experts (Hopper's warpgroup MMA,
kernels/gluon_moe.py) against `kernels.moe`'s reference on the GPU: Qwen3-30B-A3B's shape at
decode and prefill sizes, every tile set, tails along K and N with an expert never chosen,
fp16, FP8 experts (W8A8), a CUDA graph, the engine taking them when enabled. On every
machine: where the engine never takes them, and their tiles' checks. Compiled for sm_90
without a GPU by tests/kernels/target_compile.py (test_shared_memory_fit.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import gluon_hopper, gluon_moe, triton_moe
from kernels.gluon_moe import TILES, WgmmaMoeTiles, moe_experts_wgmma
from kernels.moe import ExpertBiases, moe_experts_reference
from tests.kernels.test_triton_moe import assert_kernel_close, routed

HOPPER = (
    torch.cuda.is_available()
    and torch.cuda.get_device_capability()[0] == 9
    and gluon_hopper.available()
)
on_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU and Gluon")


def experts(num: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num, 2 * inter, hidden, generator=generator) * hidden**-0.5
    down = torch.randn(num, hidden, inter, generator=generator) * inter**-0.5
    return gate_up.to("cuda", dtype), down.to("cuda", dtype)


def check(tokens: int, hidden: int, inter: int, num: int, top_k: int, dtype: torch.dtype,
          tiles: WgmmaMoeTiles | None = None) -> None:  # fmt: skip
    gate_up, down = experts(num, hidden, inter, dtype, tokens + hidden)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    x = x.to("cuda", dtype)
    weights, ids = routed(tokens, num, top_k, seed=tokens)  # expert 0 never chosen
    out = moe_experts_wgmma(x, gate_up, down, weights, ids, tiles=tiles)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    assert_kernel_close(out, moe_experts_reference(x, gate_up, down, weights, ids))


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("tokens", [1, 16, 256, 1024, 4096])  # 1: as `kvflow bench moe` runs it
def test_gpu_qwen3_30b_a3b_shapes_match_the_reference(tokens: int) -> None:
    check(tokens, 2048, 768, 128, 8, torch.bfloat16)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("tiles", [tiles for _, tiles in TILES] + [WgmmaMoeTiles(16, 64, 4, 2)])
def test_gpu_every_tile_set_with_tails_along_k_and_n_in_fp16(tiles: WgmmaMoeTiles) -> None:
    # H = 200: three steps of 64 and a tail of 8; I = 72: less than a program's columns, so
    # the gate tile reads up rows and the up tile the next expert's (masked, never stored).
    check(300, 200, 72, 6, 2, torch.float16, tiles)


def fp8_experts(num: int, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = (torch.randn(num, rows, cols, generator=generator) * 64).to(torch.float8_e4m3fn)
    scale = torch.rand(num, rows, 1, generator=generator) / (64 * cols**0.5) + 1e-5
    return q.cuda(), scale.cuda()


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "num"), [(256, 2048, 768, 128), (300, 208, 80, 6)]
)
def test_gpu_fp8_experts_match_the_reference(
    tokens: int, hidden: int, inter: int, num: int
) -> None:
    # W8A8 with a scale a row, as the Triton path: x, then h, rounded to e4m3 a row at a time.
    # The second shape: K steps of 128 with tails (208 = 128 + 80, 80), I under a program's.
    gate_up, gate_up_scale = fp8_experts(num, 2 * inter, hidden, tokens)
    down, down_scale = fp8_experts(num, hidden, inter, tokens + 1)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3)).cuda().bfloat16()
    weights, ids = routed(tokens, num, 8 if num > 8 else 2, seed=tokens)
    out = moe_experts_wgmma(x, gate_up, down, weights, ids, gate_up_scale, down_scale)
    expected = moe_experts_reference(x, gate_up, down, weights, ids, gate_up_scale, down_scale)
    # Judged as a whole: h is rounded to e4m3 before the down GEMM, so a gate or up sum in
    # another order moves an element of h by a whole e4m3 step now and then (12 % of it), and
    # the outputs it feeds by more than 1 % of their range (H100, 2026-12-05: 199 of 524,288
    # at Qwen3-30B-A3B's shape), while the output's relative error stays far below 1 %.
    error = (out.float() - expected.float()).norm() / expected.float().norm()
    assert out.shape == expected.shape and error.item() < 1e-2


@pytest.mark.gpu
@on_hopper
def test_gpu_a_cuda_graph_replays_them_on_new_inputs() -> None:
    gate_up, down = experts(128, 2048, 768, torch.bfloat16, 1)
    x = torch.zeros(256, 2048, device="cuda", dtype=torch.bfloat16)
    weights, ids = routed(256, 128, 8, seed=1)
    moe_experts_wgmma(x, gate_up, down, weights, ids)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts_wgmma(x, gate_up, down, weights, ids)
    x.copy_(torch.randn(256, 2048, generator=torch.Generator().manual_seed(1)).bfloat16())
    graph.replay()
    assert_kernel_close(out, moe_experts_reference(x, gate_up, down, weights, ids))


@pytest.mark.gpu
@on_hopper
def test_gpu_the_engine_takes_them_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    gate_up, down = experts(16, 256, 128, torch.bfloat16, 2)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(2)).to("cuda").bfloat16()
    weights, ids = routed(64, 16, 2, seed=2)
    taken = []
    monkeypatch.setattr(gluon_moe, "ENABLED", True)
    monkeypatch.setattr(
        gluon_moe, "moe_experts_wgmma",
        lambda *args: taken.append(1) or moe_experts_wgmma(*args),
    )  # fmt: skip
    out = triton_moe.moe_experts(x, gate_up, down, weights, ids)
    assert taken and out.shape == (64, 256)
    assert_kernel_close(out, moe_experts_reference(x, gate_up, down, weights, ids))
    biases = ExpertBiases(torch.zeros(16, 256, device="cuda"), torch.zeros(16, 256, device="cuda"))
    assert not gluon_moe.applies(x, gate_up, down, None, None, biases, None)  # gpt-oss: Triton's
    fp8_gate_up, scale = fp8_experts(16, 256, 256, 0)
    fp8_down, down_scale = fp8_experts(16, 256, 128, 1)
    fp8_taken = gluon_moe.applies(x, fp8_gate_up, fp8_down, scale, down_scale, None, None)
    assert fp8_taken == gluon_moe.FP8_TAKEN
    by_groups = scale.repeat(1, 1, 2)  # a scale a row and group: the Triton path's
    assert not gluon_moe.applies(x, fp8_gate_up, fp8_down, by_groups, down_scale, None, None)
    per_expert = scale[:, :1]  # one scale an expert: not what the kernels index
    assert not gluon_moe.applies(x, fp8_gate_up, fp8_down, per_expert, down_scale, None, None)


def test_off_hopper_the_engine_never_takes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    if HOPPER:
        pytest.skip("this machine runs the kernels")
    monkeypatch.setattr(gluon_moe, "ENABLED", True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.zeros(40, 96, device=device)
    gate_up, down = torch.zeros(6, 160, 96, device=device), torch.zeros(6, 96, 80, device=device)
    args = (x.bfloat16(), gate_up.bfloat16(), down.bfloat16(), None, None, None, None)
    assert not gluon_moe.applies(*args)
    weights, ids = routed(40, 6, 2, seed=0)
    out = triton_moe.moe_experts(x, gate_up, down, weights, ids)  # the Triton path
    assert out.shape == (40, 96)


def test_tiles_are_checked_and_chosen_by_the_pair_count() -> None:
    with pytest.raises(ValueError, match="block_m"):
        WgmmaMoeTiles(24, 128, 8, 3)
    with pytest.raises(ValueError, match="16 a warp"):
        WgmmaMoeTiles(16, 64, 8, 3)
    with pytest.raises(ValueError, match="stages"):
        WgmmaMoeTiles(16, 128, 8, 1)
    blocks = [gluon_moe.tiles_for(pairs).block_m for pairs in (128, 2048, 8192, 32768, 10**6)]
    assert blocks == sorted(blocks) and blocks[0] == 16 and blocks[-1] == 128
