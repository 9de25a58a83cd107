"""The Triton skinny linear layer against the torch reference, and the reference against float64.

The output is poisoned: the kernel's `torch.empty` returns NaN, so an element the kernel forgets
to write shows. CPU shapes are small and odd (N and K not multiples of the tiles) because the
kernel runs under the Triton interpreter there (tests/conftest.py sets TRITON_INTERPRET=1); the
GPU tests use Llama-3.1-8B's decode shapes. The interpreter rounds float32 to bfloat16 toward
zero where the GPU rounds to nearest, so bf16 errors on CPU are about twice those on a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

import triton

import kernels.triton_linear as triton_linear
from kernels.linear import linear_reference
from kernels.triton_activation import silu_and_mul
from kernels.triton_linear import LinearTiles, default_tiles, skinny_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DOT = LinearTiles(block_n=16, block_k=32, num_warps=4, num_stages=2)
FMA = LinearTiles(block_n=8, block_k=32, num_warps=4, num_stages=2, use_dot=False)
N, K = 37, 100  # 3 programs of 16 columns (5 in the last), 4 steps of 32 (4 in the last)


class _PoisonedTorch:
    """`torch` as kernels.triton_linear sees it, except that `empty` is filled with NaN."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*args, **kwargs).fill_(float("nan"))


@pytest.fixture(autouse=True)
def poisoned_output(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_linear, "torch", _PoisonedTorch())


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(device=DEVICE, dtype=dtype)


def make_case(
    m: int, n: int, k: int, dtype: torch.dtype, gated: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] (or [m, 2k] gate | up), weight [n, k], bias [n]."""
    gen = torch.Generator().manual_seed(seed)
    x = randn(m, 2 * k if gated else k, gen=gen, dtype=dtype)
    return x, randn(n, k, gen=gen, dtype=dtype), randn(n, gen=gen, dtype=dtype)


def rel_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected.double()).norm() / expected.double().norm()).item()


def check(out: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert out.is_contiguous() and torch.isfinite(out).all()  # every element written
    assert rel_error(out, expected) < tol


# --- The reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("gated", [False, True])
def test_reference_matches_float64(gated: bool) -> None:
    x, weight, bias = make_case(5, N, K, torch.float32, gated, seed=0)
    x64, w64 = x.double(), weight.double()
    if gated:
        gate, up = x64[:, :K], x64[:, K:]
        x64 = gate * torch.sigmoid(gate) * up  # [5, K]
    expected = x64 @ w64.T + bias.double()  # [5, N]
    out = linear_reference(x, weight, bias, gated=gated)
    assert out.dtype == torch.float32 and rel_error(out, expected) < 1e-6


# --- Triton against the reference ----------------------------------------------------------------


@pytest.mark.parametrize("tiles", [DOT, FMA], ids=["dot", "fma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_matches_reference(
    m: int, with_bias: bool, gated: bool, dtype: torch.dtype, tiles: LinearTiles
) -> None:
    x, weight, bias = make_case(m, N, K, dtype, gated, seed=m)
    bias = bias if with_bias else None
    out = skinny_linear(x, weight, bias, gated=gated, tiles=tiles)
    # bf16 gated: the reference rounds silu(gate) and its product with up, the kernel once.
    tol = 2 * REL_TOL[dtype] if gated else REL_TOL[dtype]
    check(out, linear_reference(x, weight, bias, gated=gated), tol)


@pytest.mark.parametrize("tiles", [DOT, FMA], ids=["dot", "fma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_equals_silu_and_mul_then_linear(dtype: torch.dtype, tiles: LinearTiles) -> None:
    """Fused, silu(gate) * up is rounded to x.dtype once, as triton silu_and_mul rounds it."""
    x, weight, bias = make_case(4, N, K, dtype, gated=True, seed=9)
    fused = skinny_linear(x, weight, bias, gated=True, tiles=tiles)
    unfused = skinny_linear(silu_and_mul(x), weight, bias, tiles=tiles)
    assert torch.equal(fused, unfused)


@pytest.mark.parametrize("k", [64, 200])  # a multiple of every block_k tried, and not
def test_default_tiles(k: int) -> None:
    x, weight, bias = make_case(2, 48, k, torch.float32, gated=False, seed=k)
    tiles = default_tiles(2, 48, k, torch.float32)
    assert tiles.block_k <= max(16, triton.next_power_of_2(k))
    check(skinny_linear(x, weight, bias), linear_reference(x, weight, bias), 1e-5)


def test_float16() -> None:
    x, weight, bias = make_case(2, N, K, torch.float16, gated=True, seed=3)
    out = skinny_linear(x, weight, bias, gated=True, tiles=DOT)
    check(out, linear_reference(x, weight, bias, gated=True), 2e-2)


def test_strided_rows() -> None:
    """x rows and weight rows that are slices of wider buffers (e.g. one half of a fused qkv)."""
    gen = torch.Generator().manual_seed(4)
    x = randn(3, K + 28, gen=gen, dtype=torch.float32)[:, :K]  # [3, K], row stride K + 28
    weight = randn(N, K + 12, gen=gen, dtype=torch.float32)[:, 12:]  # [N, K], row stride K + 12
    for tiles in (DOT, FMA):
        check(skinny_linear(x, weight, tiles=tiles), linear_reference(x, weight), 1e-5)


def test_one_column_block_and_long_k() -> None:
    """N smaller than block_n, K over many steps."""
    x, weight, bias = make_case(16, 5, 1000, torch.float32, gated=False, seed=5)
    check(skinny_linear(x, weight, bias, tiles=DOT), linear_reference(x, weight, bias), 1e-5)


# --- Bad inputs ---------------------------------------------------------------------------------


def bad_inputs() -> list[tuple[str, dict[str, Any], str]]:
    gen = torch.Generator().manual_seed(6)
    x, w, b = (randn(*s, gen=gen, dtype=torch.float32) for s in ((2, 32), (8, 32), (8,)))
    return [
        ("no rows", {"x": x[:0], "weight": w}, "1 to 16 rows"),
        ("17 rows", {"x": randn(17, 32, gen=gen, dtype=torch.float32), "weight": w}, "17"),
        ("3-D x", {"x": x[None], "weight": w}, "2-D"),
        ("K mismatch", {"x": x[:, :16], "weight": w}, r"\[M, K\]"),
        ("gated K", {"x": x, "weight": w, "gated": True}, "gate"),
        ("dtypes differ", {"x": x, "weight": w.double()}, "dtype"),
        ("int dtype", {"x": x.int(), "weight": w.int()}, "dtype"),
        ("x strided K", {"x": randn(32, 2, gen=gen, dtype=torch.float32).t(), "weight": w}, "K"),
        ("w strided K", {"x": x, "weight": randn(32, 8, gen=gen, dtype=torch.float32).t()}, "K"),
        ("bias shape", {"x": x, "weight": w, "bias": b[:4]}, "bias"),
        ("bias dtype", {"x": x, "weight": w, "bias": b.double()}, "bias"),
        ("wide fma", {"x": x, "weight": w, "tiles": LinearTiles(128, 512, use_dot=False)}, "reg"),
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"), [pytest.param(*case[1:], id=case[0]) for case in bad_inputs()]
)
def test_rejects_bad_inputs(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        skinny_linear(**kwargs)


@pytest.mark.parametrize(
    "fields",
    [{"block_n": 24}, {"block_k": 8}, {"block_n": 8}, {"num_warps": 3}, {"num_stages": 0}],
)
def test_rejects_bad_tiles(fields: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="LinearTiles"):
        LinearTiles(**fields)


def test_fma_takes_narrow_tiles() -> None:
    assert LinearTiles(block_n=1, use_dot=False).block_n == 1


# --- GPU: Llama-3.1-8B decode shapes --------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LLAMA_8B = {  # name: (N, K, gated)
    "qkv": (6144, 4096, False),
    "o": (4096, 4096, False),
    "gate_up": (28672, 4096, False),
    "down": (4096, 14336, False),
    "down_gated": (4096, 14336, True),
    "lm_head": (128256, 4096, False),
}


def gpu_case(
    m: int, n: int, k: int, dtype: torch.dtype, gated: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, 2 * k if gated else k, generator=gen, device="cuda").to(dtype)
    weight = torch.randn(n, k, generator=gen, device="cuda").mul_(k**-0.5).to(dtype)
    return x, weight, torch.randn(n, generator=gen, device="cuda").to(dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("shape", list(LLAMA_8B))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_llama_shapes(dtype: torch.dtype, shape: str, m: int) -> None:
    n, k, gated = LLAMA_8B[shape]
    x, weight, bias = gpu_case(m, n, k, dtype, gated, seed=m)
    expected = linear_reference(x, weight, gated=gated)
    check(skinny_linear(x, weight, gated=gated), expected, 2e-2 if gated else 1e-2)
    if gated:  # the same rounding as silu_and_mul then the same kernel: equal but for ulps
        unfused = skinny_linear(silu_and_mul(x), weight)
        check(skinny_linear(x, weight, gated=True), unfused, 2e-3)
    if m == 1:
        fma = LinearTiles(block_n=8, block_k=512, num_warps=4, num_stages=3, use_dot=False)
        check(skinny_linear(x, weight, gated=gated, tiles=fma), expected, 2e-2)
    with_bias = linear_reference(x, weight, bias, gated=gated)
    check(skinny_linear(x, weight, bias, gated=gated), with_bias, 2e-2)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replays_with_new_inputs() -> None:
    """No host sync and no allocation but the output: capturable, and correct on replay."""
    x, weight, bias = gpu_case(8, 4096, 4096, torch.bfloat16, gated=False, seed=7)
    skinny_linear(x, weight, bias)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, weight, bias)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    check(out, linear_reference(x, weight, bias), 1e-2)
