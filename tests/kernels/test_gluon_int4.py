"""The Gluon int4 kernel (Hopper's warpgroup MMA, kernels/gluon_int4.py) against
`kernels.int4`'s reference on the GPU: 8B shapes at the rows it takes, every tile shape with
tails along M and N, without zero points, fp16, a bias, split K, a CUDA graph. On every machine:
where the engine sends int4 rows (never to this kernel off Hopper), its tiles' checks, and the
column order its registers put a chunk's nibbles in. It is compiled for sm_90 without a GPU by
tests/kernels/target_compile.py (test_shared_memory_fit.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from kernels import gluon_hopper, gluon_int4, triton_int4, triton_split_k
from kernels.gluon_int4 import WgmmaTiles, default_tiles, gluon_int4_linear
from kernels.int4 import int4_linear_reference, pack_weight, quantize_int4_reference
from tests.kernels.test_fp8_linear import LLAMA_SHAPES

SHAPES = {**LLAMA_SHAPES, "qwen3 gate_up": (24576, 4096), "qwen3 down": (4096, 12288)}
HOPPER = (
    torch.cuda.is_available()
    and torch.cuda.get_device_capability()[0] == 9
    and gluon_hopper.available()
)
on_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU and Gluon")


def layer(n: int, k: int, symmetric: bool, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * 0.05
    qweight, scales, zeros = quantize_int4_reference(weight, 128, symmetric)
    zeros = zeros.cuda() if zeros is not None else None
    return qweight.cuda(), scales.to("cuda", dtype), zeros


def check(out: torch.Tensor, expected: torch.Tensor) -> None:
    # Both sides round the same dequantized weights to x's dtype; only the float32 sum's
    # order differs, so outputs differ by at most a step of the 16-bit dtype.
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("m", [65, 96, 200, 256, 512])
def test_gpu_real_shapes_match_the_reference(shape: str, m: int) -> None:
    n, k = SHAPES[shape]
    qweight, scales, zeros = layer(n, k, False, torch.bfloat16, m + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to("cuda", torch.bfloat16)
    out = gluon_int4_linear(x, qweight, scales, zeros, 128)
    check(out, int4_linear_reference(x, qweight, scales, zeros, 128))


TILES = [WgmmaTiles(64, 64, 4, 2, 1), WgmmaTiles(128, 128, 8, 3, 2), WgmmaTiles(256, 128, 8, 4, 4),
         WgmmaTiles(256, 64, 4, 3, 8), WgmmaTiles(128, 64, 4, 4, 1)]  # fmt: skip


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("tiles", TILES)
def test_gpu_each_tile_shape_with_tails_fp16_a_bias_and_split_k(tiles: WgmmaTiles) -> None:
    # N = 1000 and M = 300 end inside a tile; symmetric (no zero points); the split-K tickets
    # are back at zero after each call, and two calls add the partials alike.
    qweight, scales, zeros = layer(1000, 4096, True, torch.float16, tiles.block_m)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(300, 4096, generator=generator).to("cuda", torch.float16)
    bias = torch.randn(1000, generator=generator).to("cuda", torch.float16)
    expected = int4_linear_reference(x, qweight, scales, zeros, 128, None, bias)
    outs = [gluon_int4_linear(x, qweight, scales, zeros, 128, None, bias, tiles=tiles)]
    outs.append(gluon_int4_linear(x, qweight, scales, zeros, 128, None, bias, tiles=tiles))
    check(outs[0], expected)
    assert torch.equal(outs[0], outs[1])
    assert not triton_split_k.tickets(x.device).any()


@pytest.mark.gpu
@on_hopper
def test_gpu_the_engine_takes_it_past_the_dot_kernel_when_enabled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gluon_int4, "ENABLED", True)
    qweight, scales, zeros = layer(4096, 4096, False, torch.bfloat16, 5)
    x = torch.randn(600, 4096, generator=torch.Generator().manual_seed(5)).to("cuda").bfloat16()
    for m in (64, 65, 512, 513):  # the dot kernel, this kernel twice, the dequantize pass
        # (int4_linear asks past DEQUANTIZE_ABOVE_ROWS = 64 rows only)
        assert triton_int4.wgmma_takes(x[:m], qweight, scales, 128, None) == (m <= 512)
        out = triton_int4.int4_linear(x[:m], qweight, scales, zeros, 128)
        expected = int4_linear_reference(x[:m], qweight, scales, zeros, 128)
        if 65 <= m <= 512:
            check(out, expected)
        else:  # the dot kernel scales each step's exact sum (kernels/triton_int4.py): judged whole
            error = (out.float() - expected.float()).norm() / expected.float().norm()
            assert error.item() < 1e-2
    g_idx = (torch.arange(4096, device="cuda") // 128).to(torch.int32)  # act-order: not taken
    assert not triton_int4.wgmma_takes(x[:200], qweight, scales, 128, g_idx)
    assert not triton_int4.wgmma_takes(x[:200], qweight[:, 1:], scales, 128, None)  # off 16 B
    assert not triton_int4.wgmma_takes(x[:200], qweight, scales.half(), 128, None)


@pytest.mark.gpu
@on_hopper
def test_gpu_a_cuda_graph_replays_it_on_new_inputs() -> None:
    qweight, scales, zeros = layer(6144, 4096, False, torch.bfloat16, 7)
    x = torch.zeros(256, 4096, device="cuda", dtype=torch.bfloat16)
    gluon_int4_linear(x, qweight, scales, zeros, 128)  # compiled, tickets made, outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gluon_int4_linear(x, qweight, scales, zeros, 128)
    x.copy_(torch.randn(256, 4096, generator=torch.Generator().manual_seed(7)).bfloat16())
    graph.replay()
    check(out, int4_linear_reference(x, qweight, scales, zeros, 128))


def test_off_hopper_the_engine_never_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gluon_int4, "ENABLED", True)
    if HOPPER:
        pytest.skip("this machine runs the kernel")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.zeros(100, 256, dtype=torch.bfloat16, device=device)
    qweight = torch.zeros(8, 32, dtype=torch.int32, device=device)
    scales = torch.ones(8, 2, dtype=torch.bfloat16, device=device)
    assert not gluon_int4.applies(x, qweight, scales, 128, None)
    assert not triton_int4.wgmma_takes(x, qweight, scales, 128, None)
    with pytest.raises(ValueError, match="not on this device"):
        gluon_int4_linear(x, qweight, scales, None, 128)


def test_tiles_are_checked_and_the_defaults_split_narrow_layers() -> None:
    with pytest.raises(ValueError, match="block_m"):
        WgmmaTiles(96, 128, 8, 3, 1)
    with pytest.raises(ValueError, match="16 a warp"):
        WgmmaTiles(128, 64, 8, 3, 1)
    with pytest.raises(ValueError, match="stages"):
        WgmmaTiles(128, 128, 8, 1, 1)
    for m in (65, 128, 256, 512):
        for n, k in SHAPES.values():
            tiles = default_tiles(m, n, k, sm_count=132)
            assert tiles.block_m >= min(m, 256) and (k // gluon_int4.BLOCK_K) % tiles.split_k == 0
            programs = -(-n // tiles.block_n) * -(-m // tiles.block_m) * tiles.split_k
            assert tiles.split_k == 1 or programs <= 132
    # The sweep's picks at Qwen3-8B's layers (H100, 2026-12-06): qkv, o, gate_up, down
    picks = {
        128: [(128, 64, 4, 4, 1), (128, 64, 4, 4, 2), (128, 64, 4, 3, 1), (128, 64, 4, 4, 2)],
        256: [(256, 64, 4, 4, 1), (256, 64, 4, 4, 2), (256, 64, 4, 4, 1), (256, 64, 4, 4, 2)],
        512: [(256, 128, 8, 4, 1), (256, 64, 4, 4, 1), (256, 128, 8, 4, 1), (256, 64, 4, 4, 1)],
    }
    qwen3 = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
    for m, want in picks.items():
        got = [dataclasses.astuple(default_tiles(m, n, k, sm_count=132)) for n, k in qwen3]
        assert got == want, m


def test_a_direct_call_with_weights_that_do_not_cover_k_is_refused() -> None:
    qweight, scales = torch.zeros(8, 32, dtype=torch.int32), torch.ones(8, 2)
    gluon_int4._check_layout(256, qweight, scales, None, 128)  # fits
    for k, q, s in (
        (0, qweight[:, :0], scales[:, :0]),
        (512, qweight, scales),
        (256, qweight, scales[:, :1]),
    ):
        with pytest.raises(ValueError, match="do not cover"):
            gluon_int4._check_layout(k, q, s, None, 128)
    with pytest.raises(ValueError, match="contiguous"):
        gluon_int4._check_layout(256, qweight, torch.ones(2, 8).t(), None, 128)


def test_the_kernels_joins_and_permute_put_a_chunks_nibbles_in_column_order() -> None:
    # kernels/gluon_int4.py's _dequantize, step for step in torch (join: a new last dimension
    # of two): in the kernel layout nibble 2p + h of word c of a chunk holds column
    # 8p + 2c + h, and the kernel's registers must come out in column order.
    values = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(0))
    words = pack_weight(values)  # [8, 8]: one step of 64 columns, two chunks
    nibble = [(words >> (4 * i)) & 0xF for i in range(8)]

    def join(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.stack([a, b], dim=-1)

    low = join(join(nibble[0], nibble[1]), join(nibble[2], nibble[3]))
    high = join(join(nibble[4], nibble[5]), join(nibble[6], nibble[7]))
    w = join(low, high).reshape(8, 2, 4, 2, 2, 2).permute(0, 1, 5, 4, 2, 3).reshape(8, 64)
    assert torch.equal(w, values)
