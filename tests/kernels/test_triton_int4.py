"""The Triton int4 linear kernels against `kernels.int4`'s reference (under the interpreter on
CPU, compiled on a GPU): every row count from decode to prefill, group sizes and channel-wise
scales, symmetric and asymmetric zero points, act-order group indices, a K tail, a bias; the
row kernel with x in each dtype, read as pairs or one by one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from kernels import triton_int4, triton_int4_dequant, triton_split_k
from kernels.int4 import (
    Int4Tiles,
    int4_linear_reference,
    pack_int4,
    pack_weight,
    quantize_int4_reference,
    unpack_int4,
    unpack_weight,
)
from kernels.triton_int4 import default_tiles, int4_linear
from tests.kernels.test_fp8_linear import LLAMA_SHAPES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def random_layer(
    n: int, k: int, group_size: int, symmetric: bool, act_order: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * 0.05
    qweight, scales, zeros = quantize_int4_reference(weight, group_size, symmetric)
    g_idx = None
    if act_order:  # the groups of a column permutation, as GPTQ's desc_act writes them
        g_idx = (torch.randperm(k, generator=generator) // group_size).to(torch.int32)
        g_idx = g_idx.to(DEVICE)
    zeros = zeros.to(DEVICE) if zeros is not None else None
    return qweight.to(DEVICE), scales.to(DEVICE, DTYPE), zeros, g_idx


def check(m: int, n: int, k: int, group_size: int, symmetric: bool, act_order: bool, bias: bool):
    qweight, scales, zeros, g_idx = random_layer(n, k, group_size, symmetric, act_order, m + k)
    generator = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=generator).to(DEVICE, DTYPE)
    b = torch.randn(n, generator=generator).to(DEVICE, DTYPE) if bias else None
    out = int4_linear(x, qweight, scales, zeros, group_size, g_idx, b)
    expected = int4_linear_reference(x, qweight, scales, zeros, group_size, g_idx, b)
    assert out.dtype == DTYPE and out.shape == (m, n)
    # The same dequantized weights on both sides; only the float32 sum's order differs.
    tolerance = 2e-2 if torch.bfloat16 == DTYPE else 1e-4
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)


# Groups of 64 (and float32 x on the CPU): rows up to 4 rows, then dequant_dot tiles.
@pytest.mark.parametrize("m", [1, 2, 16, 33, 70])
@pytest.mark.parametrize("symmetric", [True, False])
def test_matches_the_reference(m: int, symmetric: bool) -> None:
    check(m, n=40, k=256, group_size=64, symmetric=symmetric, act_order=False, bias=m == 2)


@pytest.mark.parametrize("group_size", [32, 64, 192])  # 192: one group per channel (K)
def test_group_sizes_and_a_k_tail(group_size: int) -> None:
    # K = 192 is not a multiple of the K step: the masked tail, and groups across steps.
    check(3, n=24, k=192, group_size=group_size, symmetric=False, act_order=False, bias=False)


@pytest.mark.parametrize("m", [1, 5, 80])
def test_act_order_group_indices(m: int) -> None:
    check(m, n=16, k=128, group_size=32, symmetric=False, act_order=True, bias=True)


@pytest.mark.parametrize("group_size", [32, 128])  # several groups a K step, or one
def test_explicit_tiles_with_several_programs_per_dimension(group_size: int) -> None:
    qweight, scales, zeros, _ = random_layer(72, 384, group_size, False, False, 0)
    x = torch.randn(40, 384).to(DEVICE, DTYPE)
    tiles = Int4Tiles("dequant_dot", 16, 16, 128, num_warps=2, num_stages=2)
    out = int4_linear(x, qweight, scales, zeros, group_size, tiles=tiles)
    expected = int4_linear_reference(x, qweight, scales, zeros, group_size)
    tolerance = 2e-2 if DTYPE is torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="block_k >= 128"):
        tiles = Int4Tiles("dequant_dot", 16, 16, 64, 2, 2)
        int4_linear(x, qweight, scales, zeros, group_size, tiles=tiles)


def test_packing_round_trips_and_puts_column_k_at_bits_4k() -> None:
    values = torch.randint(0, 16, (3, 24), dtype=torch.uint8)
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and packed.shape == (3, 3)
    assert torch.equal(unpack_int4(packed), values)
    word = sum(int(values[0, j]) << (4 * j) for j in range(8))
    assert int(packed[0, 0]) & 0xFFFFFFFF == word


def test_the_kernel_layout_interleaves_words_in_chunks_of_32_columns() -> None:
    values = torch.randint(0, 16, (2, 64), dtype=torch.uint8)
    packed = pack_weight(values)
    assert torch.equal(unpack_weight(packed), values)
    nibbles = unpack_int4(packed)  # [2, 64] in packed order: word c of a chunk, nibble 2p + h
    for chunk, c, p, h in [(0, 0, 0, 0), (0, 1, 0, 1), (0, 3, 2, 1), (1, 2, 3, 0)]:
        column = 32 * chunk + 8 * p + 2 * c + h
        assert nibbles[1, 32 * chunk + 8 * c + 2 * p + h] == values[1, column]
    with pytest.raises(ValueError, match="divisible by 32"):
        pack_weight(values[:, :48])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("offset", [0, 1])  # 1: x's rows start 2 bytes off: read one by one
def test_the_row_kernel_reads_x_in_each_dtype(dtype: torch.dtype, offset: int) -> None:
    # Several programs along N, a K tail (K = 192 against steps of 128), a bias, two rows.
    qweight, scales, zeros, _ = random_layer(24, 192, 64, False, False, 1)
    x = torch.randn(2, 192 + offset).to(DEVICE, dtype)[:, offset:]
    bias = torch.randn(24).to(DEVICE, dtype)
    tiles = Int4Tiles("rows", 1, 8, 128, num_warps=1, num_stages=1)
    scales = scales.to(dtype)
    out = int4_linear(x, qweight, scales, zeros, 64, bias=bias, tiles=tiles)
    expected = int4_linear_reference(x, qweight, scales, zeros, 64, bias=bias)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="block_m 1"):
        int4_linear(x, qweight, scales, zeros, 64, tiles=Int4Tiles("rows", 2, 8, 128, 1, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "group_size", "symmetric"), [(2, 128, False), (20, 256, True)])
def test_the_dot_kernel_matches_the_reference(
    dtype: torch.dtype, m: int, group_size: int, symmetric: bool
) -> None:
    # 72 weight rows against tiles of 32 and 20 rows of x against 8: partial tiles both ways;
    # K = 512: 4 steps of 128, each inside one group.
    qweight, scales, zeros, _ = random_layer(72, 512, group_size, symmetric, False, m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    bias = torch.randn(72).to(DEVICE, dtype)
    scales = scales.to(dtype)
    tiles = Int4Tiles("dot", 8, 32, 128, num_warps=2, num_stages=2)
    out = int4_linear(x, qweight, scales, zeros, group_size, bias=bias, tiles=tiles)
    expected = int4_linear_reference(x, qweight, scales, zeros, group_size, bias=bias)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    # int4_linear's own choice for these inputs is this kernel; it is refused where it does
    # not apply: float32 x, groups of 64, act-order.
    assert triton_int4.dot_applies(dtype, group_size, act_order=False)
    assert default_tiles(m, 72, 512, dot=True).kind == "dot"
    default = int4_linear(x, qweight, scales, zeros, group_size, bias=bias)
    torch.testing.assert_close(default.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert not triton_int4.dot_applies(torch.float32, group_size, act_order=False)
    assert not triton_int4.dot_applies(dtype, 64, act_order=False)
    assert not triton_int4.dot_applies(dtype, group_size, act_order=True)
    with pytest.raises(ValueError, match="the dot kernel needs"):
        int4_linear(x.float(), qweight, scales, zeros, group_size, tiles=tiles)


def test_the_dot_kernel_with_large_tiles_matches_the_reference() -> None:
    """Tiles for many rows (the int4 sweep times them past 64 rows against the dequantize
    pass and a dense product, which the engine runs there): partial tiles both ways (72
    weight rows, 100 rows of x), K split in two."""
    qweight, scales, zeros, _ = random_layer(72, 512, 128, False, False, 3)
    scales = scales.to(torch.bfloat16)
    x = torch.randn(100, 512, generator=torch.Generator().manual_seed(100))
    x = x.to(DEVICE, torch.bfloat16)
    expected = int4_linear_reference(x, qweight, scales, zeros, 128)
    for tiles in (Int4Tiles("dot", 64, 128, 128, 8, 3), Int4Tiles("dot", 128, 64, 128, 4, 3, 2)):
        out = int4_linear(x, qweight, scales, zeros, 128, tiles=tiles)
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    dense = int4_linear(x, qweight, scales, zeros, 128)  # past 64 rows: dequantized
    torch.testing.assert_close(dense.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("symmetric", "act_order", "bias"), [(False, False, True), (True, True, False)]
)
def test_the_dequantize_pass_by_slices_matches_the_reference(
    monkeypatch: pytest.MonkeyPatch, symmetric: bool, act_order: bool, bias: bool
) -> None:
    """Past 64 rows the weight is dequantized a slice of its rows at a time: 72 weight rows
    in slices of 64 (the last one partial), each product written into its columns; whole
    past SLICED_MAX_ROWS rows."""
    monkeypatch.setattr(triton_int4_dequant, "DEQUANTIZE_SLICE_BYTES", 64 * 512 * DTYPE.itemsize)
    passes = []
    dequantize = triton_int4_dequant.dequantize_int4
    monkeypatch.setattr(
        triton_int4_dequant,
        "dequantize_int4",
        lambda *a, **kw: passes.append(1) or dequantize(*a, **kw),
    )
    qweight, scales, zeros, g_idx = random_layer(72, 512, 128, symmetric, act_order, 7)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(100, 512, generator=generator).to(DEVICE, DTYPE)
    b = torch.randn(72, generator=generator).to(DEVICE, DTYPE) if bias else None
    out = int4_linear(x, qweight, scales, zeros, 128, g_idx, b)
    assert len(passes) == 2
    expected = int4_linear_reference(x, qweight, scales, zeros, 128, g_idx, b)
    tolerance = 2e-2 if torch.bfloat16 == DTYPE else 1e-4
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
    monkeypatch.setattr(triton_int4_dequant, "SLICED_MAX_ROWS", 64)
    int4_linear(x, qweight, scales, zeros, 128, g_idx, b)
    assert len(passes) == 3  # whole


@pytest.mark.parametrize("split_k", [2, 3])  # 3: the last split's share of 4 steps is empty
def test_the_dot_kernel_splits_k_and_leaves_its_tickets_at_zero(split_k: int) -> None:
    qweight, scales, zeros, _ = random_layer(72, 512, 128, False, False, split_k)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    scales = scales.to(torch.bfloat16)
    tiles = Int4Tiles("dot", 8, 32, 128, num_warps=2, num_stages=2, split_k=split_k)
    expected = int4_linear_reference(x, qweight, scales, zeros, 128)
    outs = []
    for _ in range(2):  # the second call finds the counters as the first left them
        outs.append(int4_linear(x, qweight, scales, zeros, 128, tiles=tiles))
        torch.testing.assert_close(outs[-1].float(), expected.float(), rtol=2e-2, atol=2e-2)
        assert not triton_split_k.tickets(x.device).any()
    assert torch.equal(outs[0], outs[1])  # the partials added in split order, every time
    # At 1-8 rows: qkv (192 tiles), o and down (56 iterations of 256 columns) split in 4,
    # gate_up not; at 32, down (112 iterations of 128, 32 tiles) in 8.
    for m in (1, 8):
        splits = [default_tiles(m, n, k).split_k for n, k in LLAMA_SHAPES.values()]
        assert sorted(splits) == [1, 4, 4, 4]
    assert default_tiles(32, 4096, 14336).split_k == 8
    with pytest.raises(ValueError, match="dot kernel only"):
        Int4Tiles("rows", 1, 8, 128, 1, 1, split_k=2)


@pytest.mark.parametrize(("block_k", "split_k"), [(256, 1), (512, 1), (256, 2)])
def test_the_dot_kernel_takes_several_steps_an_iteration(block_k: int, split_k: int) -> None:
    # K = 384: 3 steps of 128, so the last iteration (or a split's) runs past its end, masked;
    # groups of 128 change inside an iteration.
    qweight, scales, zeros, _ = random_layer(40, 384, 128, False, False, block_k)
    x = torch.randn(3, 384, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    scales = scales.to(torch.bfloat16)
    tiles = Int4Tiles("dot", 8, 32, block_k, num_warps=2, num_stages=2, split_k=split_k)
    out = int4_linear(x, qweight, scales, zeros, 128, tiles=tiles)
    expected = int4_linear_reference(x, qweight, scales, zeros, 128)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="K steps of 128"):
        int4_linear(x, qweight, scales, zeros, 128, tiles=dataclasses.replace(tiles, block_k=192))


def test_bad_inputs_are_refused() -> None:
    qweight, scales, zeros, _ = random_layer(16, 64, 32, False, False, 0)
    x = torch.randn(2, 64).to(DEVICE, DTYPE)
    with pytest.raises(ValueError, match="must be"):
        int4_linear(x[:, :32], qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match="do not cover"):
        int4_linear(x, qweight, scales[:, :1], zeros[:, :1], 32)
    with pytest.raises(ValueError, match="zeros"):
        int4_linear(x, qweight, scales, zeros.to(torch.int32), 32)
    with pytest.raises(ValueError, match="multiples of 32"):
        int4_linear(x, qweight, scales.repeat(1, 2), zeros.repeat(1, 2), 16)
    empty = torch.zeros(16, 0, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="positive multiples"):  # K = 0
        int4_linear(x[:, :0], empty, scales[:, :0], zeros[:, :0], 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", sorted(LLAMA_SHAPES))
@pytest.mark.parametrize("m", [1, 7, 16, 20, 64, 300])
def test_gpu_real_shapes_match_the_reference(shape: str, m: int) -> None:
    # Judged as a whole: the reference rounds each dequantized weight to bf16 and the kernel
    # does not (it sums the exact q - z times x and scales the sum), so over K = 14336
    # products single outputs differ by a few bf16 steps (measured: the kernel is the closer
    # of the two to float64), while the relative error of the output stays near 1e-3.
    n, k = LLAMA_SHAPES[shape]
    qweight, scales, zeros, g_idx = random_layer(n, k, 128, False, m == 7, m + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, DTYPE)
    out = int4_linear(x, qweight, scales, zeros, 128, g_idx)
    expected = int4_linear_reference(x, qweight, scales, zeros, 128, g_idx)
    assert out.dtype == DTYPE and out.shape == (m, n)
    error = (out.float() - expected.float()).norm() / expected.float().norm()
    assert error.item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", sorted(LLAMA_SHAPES))
@pytest.mark.parametrize("m", [1, 20])
def test_gpu_fp16_at_real_shapes_matches_the_reference(shape: str, m: int) -> None:
    # The dot kernel's fp16 operand (1024 + q less 1024 + z) at its 8-, 8 x 64- and 32-row
    # tiles, with zero points.
    n, k = LLAMA_SHAPES[shape]
    qweight, scales, zeros, _ = random_layer(n, k, 128, False, False, m + k)
    scales = scales.to(torch.float16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.float16)
    out = int4_linear(x, qweight, scales, zeros, 128)
    expected = int4_linear_reference(x, qweight, scales, zeros, 128)
    error = (out.float() - expected.float()).norm() / expected.float().norm()
    assert out.dtype == torch.float16 and error.item() < 1e-2
