"""GGUF blocks: the torch reference against the `gguf` package (llama.cpp's own Python reader,
an independent implementation), and the Triton kernels against the reference (under the
interpreter on CPU, compiled at real shapes on a GPU)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels.gguf import GGUF_TYPES, dequantize_gguf_reference, gguf_linear_reference, row_bytes
from sweeps.gguf_writer import random_weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TYPES = sorted(GGUF_TYPES)


def raw_weight(qtype: str, rows: int, k: int, seed: int) -> torch.Tensor:
    data = random_weight(qtype, rows, k, 0.05, np.random.default_rng(seed))
    return torch.from_numpy(np.ascontiguousarray(data))


def any_bytes(qtype: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Every byte random but the f16 scales (kept finite): all bit patterns of the values,
    scales, mins and high bits."""
    t = GGUF_TYPES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // t.block_elems, t.block_bytes), dtype=np.uint8)
    f16_fields = {"Q6_K": (208,), "Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,)}.get(qtype, (0, 2))
    for at in f16_fields:
        values = rng.uniform(-1, 1, raw.shape[:2]).astype(np.float16)
        raw[..., at : at + 2] = values.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_reference_dequantizes_as_the_gguf_package(qtype: str) -> None:
    raw = any_bytes(qtype, rows=6, k=512, seed=len(qtype))
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    ours = dequantize_gguf_reference(torch.from_numpy(raw.copy()), qtype, 512)
    np.testing.assert_array_equal(ours.numpy(), expected)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_blocks_the_gguf_package_quantizes_come_back_near_the_weights(qtype: str) -> None:
    weight = np.random.default_rng(0).standard_normal((8, 256), dtype=np.float32)
    raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType[qtype])
    ours = dequantize_gguf_reference(torch.from_numpy(raw), qtype, 256).numpy()
    step = np.abs(weight).max(axis=1, keepdims=True) / (127 if qtype == "Q8_0" else 7)
    assert np.all(np.abs(ours - weight) <= step)


def test_the_gguf_layout_is_checked() -> None:
    assert row_bytes("Q4_K", 512) == 288 and row_bytes("Q8_0", 64) == 68
    with pytest.raises(ValueError, match="whole blocks of 256"):
        row_bytes("Q6_K", 320)
    with pytest.raises(ValueError, match=r"needs \[N, 36\] uint8"):
        dequantize_gguf_reference(torch.zeros(2, 40, dtype=torch.uint8), "Q4_0", 64)


triton_gguf = pytest.importorskip("kernels.triton_gguf", exc_type=ImportError)


def check_linear(qtype: str, m: int, n: int, k: int, bias: bool, seed: int) -> None:
    raw = raw_weight(qtype, n, k, seed).to(DEVICE)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(DEVICE, DTYPE)
    b = torch.randn(n, generator=generator).to(DEVICE, DTYPE) if bias else None
    out = triton_gguf.gguf_linear(x, raw, qtype, b)
    expected = gguf_linear_reference(x, raw, qtype, b)
    assert out.dtype == DTYPE and out.shape == (m, n)
    # The kernels multiply float32 weights (bf16 for tl.dot), the reference x's dtype.
    scale = expected.float().abs().max().item()
    tolerance = 2e-2 if torch.bfloat16 == DTYPE else 1e-5
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=tolerance * scale)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 3, 20, 70])  # multiply-add, tl.dot tiles, dequantize + matmul
def test_triton_matches_the_reference(qtype: str, m: int) -> None:
    # K = 96 is not a multiple of the 256-value step: the masked tail of 32-value blocks.
    k = 512 if qtype.endswith("_K") else 96
    check_linear(qtype, m, n=24, k=k, bias=m == 3, seed=m)


@pytest.mark.parametrize("qtype", TYPES)
def test_triton_dequantizes_as_the_reference(qtype: str) -> None:
    raw = torch.from_numpy(any_bytes(qtype, rows=20, k=512, seed=1)).to(DEVICE)
    out = triton_gguf.dequantize_gguf(raw, qtype, 512, torch.float32)
    torch.testing.assert_close(out, dequantize_gguf_reference(raw, qtype, 512), rtol=0, atol=0)


def test_triton_refuses_a_type_without_a_kernel() -> None:
    with pytest.raises(ValueError, match="no GGUF kernel for Q3_K"):
        triton_gguf.gguf_linear(torch.zeros(1, 256), torch.zeros(1, 110, dtype=torch.uint8), "Q3_K")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K"])
@pytest.mark.parametrize("m", [1, 4, 16, 64, 256])
def test_triton_at_llama_shapes(qtype: str, m: int) -> None:
    for n, k in ((6144, 4096), (4096, 14336)):  # qkv, down
        check_linear(qtype, m, n, k, bias=False, seed=m + n)
