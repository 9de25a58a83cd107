"""The Gluon FP8 kernel (Hopper's warpgroup MMA, kernels/gluon_fp8.py) against
`kernels.fp8`'s reference on the GPU: 8B shapes at the rows it takes, every tile shape with
tails along M and N, a bias, split K, a CUDA graph, and the engine's FP8 layer taking it. On
every machine: where the engine sends FP8 rows (never to this kernel off Hopper). It is
compiled for sm_90 without a GPU by tests/kernels/target_compile.py
(test_shared_memory_fit.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import gluon_fp8, gluon_hopper, quantized_ops, triton_split_k
from kernels.fp8 import FP8, Fp8Rows, fp8_linear_reference, quantize_fp8_rowwise_reference
from kernels.gluon_fp8 import gluon_fp8_linear
from kernels.gluon_wgmma import WgmmaTiles
from tests.kernels.test_fp8_linear import LLAMA_SHAPES

SHAPES = {**LLAMA_SHAPES, "qwen3 gate_up": (24576, 4096), "qwen3 down": (4096, 12288)}
HOPPER = (
    torch.cuda.is_available()
    and torch.cuda.get_device_capability()[0] == 9
    and gluon_hopper.available()
)
on_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU and Gluon")


def layer(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5
    qweight, scale = quantize_fp8_rowwise_reference(weight)
    return qweight.cuda(), scale[:, 0].contiguous().cuda()


def quantized(m: int, k: int, seed: int) -> Fp8Rows:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
    return Fp8Rows.quantize(x)


def check(out: torch.Tensor, expected: torch.Tensor) -> None:
    # Both sides multiply the same e4m3 values exactly and sum in float32; only the sum's order
    # differs, and the result is rounded once to bf16.
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("m", [65, 96, 200, 256, 512])
def test_gpu_real_shapes_match_the_reference(shape: str, m: int) -> None:
    n, k = SHAPES[shape]
    qweight, scale = layer(n, k, m + k)
    rows = quantized(m, k, m)
    check(gluon_fp8_linear(rows, qweight, scale), fp8_linear_reference(rows, qweight, scale))


TILES = [WgmmaTiles(64, 64, 4, 2, 1), WgmmaTiles(128, 128, 8, 3, 2), WgmmaTiles(256, 128, 8, 4, 4),
         WgmmaTiles(256, 64, 4, 3, 8), WgmmaTiles(128, 64, 4, 4, 1)]  # fmt: skip


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("tiles", TILES)
def test_gpu_each_tile_shape_with_tails_a_bias_and_split_k(tiles: WgmmaTiles) -> None:
    # N = 1000 and M = 300 end inside a tile; the split-K tickets are back at zero after each
    # call, and two calls add the partials alike.
    qweight, scale = layer(1000, 4096, tiles.block_m)
    rows = quantized(300, 4096, 3)
    bias = torch.randn(1000, generator=torch.Generator().manual_seed(3)).to("cuda").bfloat16()
    expected = fp8_linear_reference(rows, qweight, scale, bias)
    outs = [gluon_fp8_linear(rows, qweight, scale, bias, tiles=tiles) for _ in range(2)]
    check(outs[0], expected)
    assert torch.equal(outs[0], outs[1])
    assert not triton_split_k.tickets(rows.q.device).any()


@pytest.mark.gpu
@on_hopper
def test_gpu_the_engine_takes_it_between_the_gemv_and_cublaslt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    kernel = gluon_fp8.gluon_fp8_linear

    def counted(rows: Fp8Rows, *args: torch.Tensor | None) -> torch.Tensor:
        calls.append(rows.q.shape[0])
        return kernel(rows, *args)

    monkeypatch.setattr(gluon_fp8, "gluon_fp8_linear", counted)
    qweight, scale = layer(4096, 4096, 5)
    x = torch.randn(600, 4096, generator=torch.Generator().manual_seed(5)).to("cuda").bfloat16()
    for m in (64, 65, 512, 513):  # the GEMV, this kernel twice, cuBLASLt
        out = quantized_ops.fp8_linear(x[:m], qweight, scale)
        check(out, fp8_linear_reference(x[:m], qweight, scale))
    assert calls == [65, 512]


@pytest.mark.gpu
@on_hopper
def test_gpu_a_cuda_graph_replays_it_on_new_inputs() -> None:
    qweight, scale = layer(6144, 4096, 7)
    rows = Fp8Rows(
        torch.zeros(256, 4096, device="cuda", dtype=FP8),
        torch.ones(256, 1, device="cuda"),
        torch.bfloat16,
    )
    gluon_fp8_linear(rows, qweight, scale)  # compiled, tickets made, outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gluon_fp8_linear(rows, qweight, scale)
    new = quantized(256, 4096, 7)
    rows.q.copy_(new.q)
    rows.scale.copy_(new.scale)
    graph.replay()
    check(out, fp8_linear_reference(rows, qweight, scale))


def test_off_hopper_the_engine_never_takes_it() -> None:
    if HOPPER:
        pytest.skip("this machine runs the kernel")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = Fp8Rows(
        torch.zeros(100, 256, dtype=FP8, device=device),
        torch.ones(100, 1, device=device),
        torch.bfloat16,
    )
    qweight = torch.zeros(8, 256, dtype=FP8, device=device)
    assert not gluon_fp8.applies(rows, qweight)
    with pytest.raises(ValueError, match="not on this device"):
        gluon_fp8_linear(rows, qweight, torch.ones(8, device=device))


def test_the_defaults_split_narrow_layers_within_one_wave() -> None:
    for m in (65, 128, 256, 512):
        for n, k in SHAPES.values():
            tiles = gluon_fp8.default_tiles(m, n, k, sm_count=132)
            assert tiles.block_m >= min(m, 256) and (k // gluon_fp8.BLOCK_K) % tiles.split_k == 0
            programs = -(-n // tiles.block_n) * -(-m // tiles.block_m) * tiles.split_k
            assert tiles.split_k == 1 or programs <= 132
