"""The Triton skinny linear layer against the torch reference, and the reference against float64.

The output is poisoned: the kernel's `torch.empty` returns NaN, so an element the kernel forgets
to write shows. CPU shapes are small and odd (N and K not multiples of the tiles) because the
kernel runs under the Triton interpreter there (tests/conftest.py sets TRITON_INTERPRET=1); the
GPU tests use Llama-3.1-8B's decode shapes. The interpreter rounds float32 to bfloat16 toward
zero where the GPU rounds to nearest, so bf16 errors on CPU are about twice those on a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

import kernels.triton_linear as triton_linear
from kernels.activation import gelu_tanh_and_mul_reference, silu_and_mul_reference
from kernels.linear import linear_reference
from kernels.pdl import set_pdl
from kernels.triton_activation import gelu_tanh_and_mul, silu_and_mul
from kernels.triton_linear import (
    FMA_MAX_ACC_PER_THREAD,
    MAX_ROWS,
    NO_PDL_MAX_ROWS,
    LinearTiles,
    default_tiles,
    skinny_linear,
    skinny_max_rows,
)

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
    m: int, n: int, k: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k], weight [n, k], bias [n]."""
    gen = torch.Generator().manual_seed(seed)
    x = randn(m, k, gen=gen, dtype=dtype)
    return x, randn(n, k, gen=gen, dtype=dtype), randn(n, gen=gen, dtype=dtype)


def rel_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected.double()).norm() / expected.double().norm()).item()


def check(out: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert out.is_contiguous() and torch.isfinite(out).all()  # every element written
    assert rel_error(out, expected) < tol


# --- The reference ------------------------------------------------------------------------------


def test_reference_matches_float64() -> None:
    x, weight, bias = make_case(5, N, K, torch.float32, seed=0)
    expected = x.double() @ weight.double().T + bias.double()  # [5, N]
    out = linear_reference(x, weight, bias)
    assert out.dtype == torch.float32 and rel_error(out, expected) < 1e-6


# --- Triton against the reference ----------------------------------------------------------------


@pytest.mark.parametrize("tiles", [DOT, FMA, None], ids=["dot", "fma", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", [1, 3, 16, 17, 64])
def test_matches_reference(
    m: int, with_bias: bool, dtype: torch.dtype, tiles: LinearTiles | None
) -> None:
    """None: default_tiles, fma at M = 1 and dot above, K = 300 in steps of up to 512."""
    x, weight, bias = make_case(m, N, K if tiles else 300, dtype, seed=m)
    bias = bias if with_bias else None
    check(
        skinny_linear(x, weight, bias, tiles=tiles),
        linear_reference(x, weight, bias),
        REL_TOL[dtype],
    )


@pytest.mark.parametrize(
    ("m", "n", "k"),  # each pick for 2-64 rows and short K, at a small N and K (block_k <= 256)
    [
        (8, 6144, 4096),
        (8, 24576, 4096),
        (8, 4096, 14336),
        (32, 24576, 4096),
        (32, 6144, 4096),
        (32, 4096, 14336),
        (48, 151936, 4096),
        (64, 6144, 4096),
        (64, 28672, 4096),
        (64, 4096, 4096),
        (9, 960, 576),
        (1, 49152, 576),
    ],
)
def test_default_picks_match_reference(m: int, n: int, k: int) -> None:
    tiles = default_tiles(m, n, k, torch.bfloat16)
    x, weight, bias = make_case(m, 2 * tiles.block_n + 3, 300, torch.bfloat16, seed=m + n)
    small = dataclasses.replace(tiles, block_k=min(tiles.block_k, 256))
    check(skinny_linear(x, weight, bias, tiles=small), linear_reference(x, weight, bias), 1e-2)


@pytest.mark.parametrize(
    ("m", "n", "k", "dtype", "expected"),
    [  # Llama-3.1-8B's down and lm_head are the wide cases; float32 halves block_k
        (1, 4096, 14336, torch.bfloat16, LinearTiles(8, 1024, 4, 2, use_dot=False)),
        (1, 128256, 4096, torch.bfloat16, LinearTiles(8, 1024, 4, 2, use_dot=False)),
        (1, 64128, 4096, torch.bfloat16, LinearTiles(8, 1024, 4, 2, use_dot=False)),  # a rank's
        (1, 28672, 4096, torch.bfloat16, LinearTiles(4, 1024, 4, 2, use_dot=False)),
        (1, 6144, 4096, torch.bfloat16, LinearTiles(4, 1024, 4, 2, use_dot=False)),
        (1, 6144, 4096, torch.float32, LinearTiles(4, 512, 4, 2, use_dot=False)),
        (2, 4096, 14336, torch.bfloat16, LinearTiles(32, 512, 4, 4)),
        (16, 128256, 4096, torch.float16, LinearTiles(32, 512, 4, 4)),
        (16, 28672, 4096, torch.bfloat16, LinearTiles(32, 128, 4, 5)),  # gate_up
        (8, 6144, 4096, torch.bfloat16, LinearTiles(16, 512, 4, 3)),  # qkv
        (2, 4096, 4096, torch.bfloat16, LinearTiles(32, 512, 4, 4)),  # o
        (17, 4096, 14336, torch.bfloat16, LinearTiles(32, 512, 4, 4)),  # down, 32-row x tile
        (32, 24576, 4096, torch.bfloat16, LinearTiles(32, 512, 4, 4)),  # Qwen3-8B gate_up
        (32, 6144, 4096, torch.bfloat16, LinearTiles(16, 256, 4, 4)),  # qkv
        (32, 151936, 4096, torch.bfloat16, LinearTiles(32, 512, 4, 4)),  # lm_head
        (32, 6144, 4096, torch.float32, LinearTiles(16, 128, 4, 4)),
        (33, 151936, 4096, torch.bfloat16, LinearTiles(128, 128, 8, 3)),  # 64-row x tile
        (64, 28672, 4096, torch.bfloat16, LinearTiles(128, 128, 8, 3)),  # gate_up
        (64, 6144, 4096, torch.bfloat16, LinearTiles(64, 128, 4, 4)),  # qkv
        (64, 4096, 14336, torch.bfloat16, LinearTiles(32, 256, 4, 4)),
        (4, 4096, 4096, torch.float32, LinearTiles(32, 256, 4, 4)),
        (4, 28672, 4096, torch.float32, LinearTiles(32, 64, 4, 5)),
        # SmolLM2-135M: short K steps for a short K (qkv, gate_up, down, lm_head)
        (9, 960, 576, torch.bfloat16, LinearTiles(16, 128, 4, 5)),
        (9, 3072, 576, torch.bfloat16, LinearTiles(32, 128, 4, 5)),
        (16, 576, 1536, torch.bfloat16, LinearTiles(16, 128, 4, 5)),
        (9, 49152, 576, torch.bfloat16, LinearTiles(32, 64, 2, 4)),
        (1, 49152, 576, torch.bfloat16, LinearTiles(32, 64, 2, 4)),
        (1, 960, 576, torch.bfloat16, LinearTiles(4, 1024, 4, 2, use_dot=False)),
        (17, 960, 576, torch.bfloat16, LinearTiles(32, 512, 4, 4)),
        (4, 48, 20, torch.bfloat16, LinearTiles(16, 32, 4, 5)),  # block_k <= next pow2 of K
        (1, 48, 8, torch.float32, LinearTiles(4, 16, 4, 2, use_dot=False)),  # and >= 16
    ],
)
def test_default_tiles_picks(
    m: int, n: int, k: int, dtype: torch.dtype, expected: LinearTiles
) -> None:
    tiles = default_tiles(m, n, k, dtype)
    assert tiles == expected and tiles.acc_per_thread(m) <= FMA_MAX_ACC_PER_THREAD


@pytest.mark.parametrize("m", [1, 2])  # fma, dot
@pytest.mark.parametrize("k", [64, 200])  # a multiple of every default block_k, and not
def test_default_tiles(k: int, m: int) -> None:
    x, weight, bias = make_case(m, 48, k, torch.float32, seed=k + m)
    assert default_tiles(m, 48, k, torch.float32).use_dot == (m > 1)
    check(skinny_linear(x, weight, bias), linear_reference(x, weight, bias), 1e-5)


@pytest.mark.parametrize("tiles", [DOT, FMA], ids=["dot", "fma"])
def test_float16(tiles: LinearTiles) -> None:
    x, weight, bias = make_case(2, N, K, torch.float16, seed=3)
    check(skinny_linear(x, weight, bias, tiles=tiles), linear_reference(x, weight, bias), 1e-2)


def test_strided_rows() -> None:
    """x rows and weight rows that are slices of wider buffers (e.g. one half of a fused qkv)."""
    gen = torch.Generator().manual_seed(4)
    x = randn(3, K + 28, gen=gen, dtype=torch.float32)[:, :K]  # [3, K], row stride K + 28
    weight = randn(N, K + 12, gen=gen, dtype=torch.float32)[:, 12:]  # [N, K], row stride K + 12
    for tiles in (DOT, FMA):
        check(skinny_linear(x, weight, tiles=tiles), linear_reference(x, weight), 1e-5)


@pytest.mark.parametrize("tiles", [DOT, FMA], ids=["dot", "fma"])
def test_one_column_block_and_long_k(tiles: LinearTiles) -> None:
    """N smaller than block_n, K over many steps."""
    x, weight, bias = make_case(16, 5, 1000, torch.float32, seed=5)
    check(skinny_linear(x, weight, bias, tiles=tiles), linear_reference(x, weight, bias), 1e-5)


# --- Bad inputs ---------------------------------------------------------------------------------


def bad_inputs() -> list[tuple[str, dict[str, Any], str]]:
    gen = torch.Generator().manual_seed(6)
    x, w, b = (randn(*s, gen=gen, dtype=torch.float32) for s in ((2, 32), (8, 32), (8,)))
    return [
        ("no rows", {"x": x[:0], "weight": w}, "1 to 64 rows"),
        ("65 rows", {"x": randn(65, 32, gen=gen, dtype=torch.float32), "weight": w}, "65"),
        ("3-D x", {"x": x[None], "weight": w}, "2-D"),
        ("K mismatch", {"x": x[:, :16], "weight": w}, r"\[M, K\]"),
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
LLAMA_8B = {  # name: (N, K)
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def gpu_case(
    m: int, n: int, k: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    weight = torch.randn(n, k, generator=gen, device="cuda").mul_(k**-0.5).to(dtype)
    return x, weight, torch.randn(n, generator=gen, device="cuda").to(dtype)


def test_skinny_max_rows_follows_pdl() -> None:
    """ops.linear gives the kernel 17-64 rows only where kernels launch with PDL: never on
    the CPU or with --disable-pdl, on CUDA from Hopper on."""
    x = torch.zeros(1, 16, device=DEVICE)
    takes_pdl = x.is_cuda and torch.cuda.get_device_capability() >= (9, 0)
    try:
        assert skinny_max_rows(x) == (MAX_ROWS if takes_pdl else NO_PDL_MAX_ROWS)
        set_pdl(False)
        assert skinny_max_rows(x) == NO_PDL_MAX_ROWS == 16
    finally:
        set_pdl(True)


@pytest.mark.parametrize("tiles", [DOT, FMA], ids=["dot", "fma"])
@pytest.mark.parametrize("gated", ["silu", "gelu_tanh"])
def test_gated_input_is_made_from_gate_up(tiles: LinearTiles, gated: str) -> None:
    """`gated`: x is a gated MLP's gate_up [M, 2K] and the input is act(gate) * up, made as each
    K step loads it (the down projection and its activation in one launch)."""
    gen = torch.Generator().manual_seed(7)
    m = 3
    gate_up = randn(m, 2 * K, gen=gen, dtype=torch.float32)
    weight, bias = randn(N, K, gen=gen, dtype=torch.float32), randn(N, gen=gen, dtype=torch.float32)
    act = gelu_tanh_and_mul_reference if gated == "gelu_tanh" else silu_and_mul_reference
    expected = linear_reference(act(gate_up), weight, bias)
    check(skinny_linear(gate_up, weight, bias, tiles=tiles, gated=gated), expected, 1e-5)
    other = silu_and_mul_reference if gated == "gelu_tanh" else gelu_tanh_and_mul_reference
    assert rel_error(linear_reference(other(gate_up), weight, bias), expected) > 1e-3
    with pytest.raises(ValueError, match="gated: one of"):
        skinny_linear(gate_up, weight, gated="relu")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("shape", list(LLAMA_8B))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_llama_shapes(dtype: torch.dtype, shape: str, m: int) -> None:
    """The default tiles (fma at M = 1, dot above), and the other variant at M = 1."""
    n, k = LLAMA_8B[shape]
    x, weight, bias = gpu_case(m, n, k, dtype, seed=m)
    expected = linear_reference(x, weight)
    check(skinny_linear(x, weight), expected, 1e-2)
    if m == 1:
        dot = LinearTiles(block_n=32, block_k=512, num_warps=4, num_stages=4)
        check(skinny_linear(x, weight, tiles=dot), expected, 1e-2)
    check(skinny_linear(x, weight, bias), linear_reference(x, weight, bias), 1e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("gated", ["silu", "gelu_tanh"])
def test_gpu_gated_input_is_the_activations_product(gated: str, m: int) -> None:
    """Llama's down projection with its activation made in the GEMV: bit for bit what the
    activation kernel then the GEMV give (the same float32 math, rounded at the same point)."""
    n, k = LLAMA_8B["down"]
    _, weight, bias = gpu_case(m, n, k, torch.bfloat16, seed=m)
    gate_up = torch.randn(m, 2 * k, device="cuda").to(torch.bfloat16)
    product = (gelu_tanh_and_mul if gated == "gelu_tanh" else silu_and_mul)(gate_up)
    fused = skinny_linear(gate_up, weight, bias, gated=gated)
    assert torch.equal(fused, skinny_linear(product, weight, bias))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 8])  # fma, dot
def test_gpu_cuda_graph_replays_with_new_inputs(m: int) -> None:
    """No host sync and no allocation but the output: capturable, and correct on replay."""
    x, weight, bias = gpu_case(m, 4096, 4096, torch.bfloat16, seed=7)
    skinny_linear(x, weight, bias)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, weight, bias)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    check(out, linear_reference(x, weight, bias), 1e-2)


# --- LoRA in the epilogue -----------------------------------------------------------------------


def lora_case(
    m: int, n: int, k: int, dtype: torch.dtype, seed: int, pieces: tuple[int, ...], rank: int = 16
):
    """A LoRA delta for m rows (slots 0..2 of 3, or -1: the base model), shrunk by the Triton
    shrink in splits of 16 columns, and the same with a stale slot (9) where -1 is."""
    from kernels.lora import LoraDelta
    from kernels.triton_lora import lora_shrink

    gen = torch.Generator().manual_seed(seed)
    x = randn(m, k, gen=gen, dtype=dtype)
    lora_a = randn(3, len(pieces), rank, k, gen=gen, dtype=dtype) * 0.1
    lora_b = randn(3, n, rank, gen=gen, dtype=dtype) * 0.1
    slots = torch.tensor([[0, -1, 2, -1, 1][i % 5] for i in range(m)], dtype=torch.int32)
    slots = slots.to(DEVICE)
    shrunk = lora_shrink(x, lora_a, slots, k_per_split=16)
    assert shrunk.shape[0] > 1  # partial sums for the epilogue to add up
    stale = torch.where(slots < 0, 9, slots).to(torch.int32)  # a padding row's leftover
    return x, LoraDelta(shrunk, lora_b, slots, pieces), LoraDelta(shrunk, lora_b, stale, pieces)


@pytest.mark.parametrize("tiles", [FMA, DOT], ids=["fma", "dot"])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize(
    ("pieces", "rank"),
    [((64, 32, 32), 16), ((36, 92), 16), ((64, 32, 32), 64)],
    ids=["fused", "straddles", "rank-64"],
)
def test_lora_delta_in_the_epilogue(
    tiles: LinearTiles, m: int, pieces: tuple[int, ...], rank: int
) -> None:
    """Each row gets its adapter's delta: in the epilogue where the column blocks lie within
    pieces and B's tile fits in registers, else by the expand kernel after the launch (a
    block straddling two pieces; rank 64 on 16 rows)."""
    dtype = torch.float32
    n = sum(pieces)
    x, lora, stale = lora_case(m, n, K, dtype, seed=m, pieces=pieces, rank=rank)
    _, weight, bias = make_case(m, n, K, dtype, seed=m + 1)
    expected = linear_reference(x, weight, bias, lora)
    without = linear_reference(x, weight, bias)
    assert rel_error(without, expected) > 1e-2  # the delta is not lost in the tolerance
    check(skinny_linear(x, weight, bias, tiles=tiles, lora=stale), expected, REL_TOL[dtype])


@pytest.mark.parametrize("m", [32, 64])
def test_lora_delta_at_the_larger_row_tiles(m: int) -> None:
    """Rank 16 on blocks of 16 columns: in the epilogue at 32 rows (8,192 values of B), by
    the expand after the launch at 64."""
    dtype, pieces = torch.float32, (64, 32, 32)
    x, lora, stale = lora_case(m, sum(pieces), K, dtype, seed=m, pieces=pieces, rank=16)
    _, weight, bias = make_case(m, sum(pieces), K, dtype, seed=m + 1)
    expected = linear_reference(x, weight, bias, lora)
    assert triton_linear._fuses(lora, DOT, m) == (m == 32)
    check(skinny_linear(x, weight, bias, tiles=DOT, lora=stale), expected, REL_TOL[dtype])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 8, 16, 32, 64])
def test_gpu_lora_delta_in_the_epilogue(m: int) -> None:
    from kernels.lora import LoraDelta
    from kernels.triton_lora import lora_shrink

    pieces = (4096, 1024, 1024)
    x, weight, bias = gpu_case(m, sum(pieces), 4096, torch.bfloat16, seed=m)
    gen = torch.Generator(device="cuda").manual_seed(m)
    lora_a = torch.randn(8, 3, 16, 4096, generator=gen, device="cuda").mul_(0.02).bfloat16()
    lora_b = torch.randn(8, sum(pieces), 16, generator=gen, device="cuda").mul_(0.02).bfloat16()
    slots = (torch.arange(m, device="cuda") % 9 - 1).to(torch.int32)
    lora = LoraDelta(lora_shrink(x, lora_a, slots), lora_b, slots, pieces)
    expected = linear_reference(x, weight, bias, lora)
    check(skinny_linear(x, weight, bias, lora=lora), expected, 1e-2)
