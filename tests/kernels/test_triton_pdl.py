"""Programmatic dependent launch (kernels.triton_pdl) changes when kernels start, never a value.

- Each PDL kernel (the int4 dot kernel among them) waits for the kernel before it: a producer
  that lets its dependents launch at once, then writes their input only after 200 us, must
  still be seen whole.
- A chain of dependent decode kernels (RMSNorm, the bf16 skinny linear and the FP8 GEMV, the FP8
  quantization, SiLU-and-mul, argmax) captured in a CUDA graph gives the same bits with PDL
  and without (`set_pdl(False)`, what --disable-pdl does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, globaltimer

from kernels import ops, quantized_ops
from kernels.argmax import argmax_reference
from kernels.embedding import embedding_rows_reference
from kernels.fp8 import fp8_linear_reference, quantize_fp8_rowwise_reference
from kernels.int4 import int4_linear_reference, quantize_int4_reference
from kernels.norm import fused_add_rms_norm_reference, rms_norm_reference
from kernels.pdl import set_pdl
from kernels.triton_pdl import launches_early

HIDDEN, INTER, LAYERS, VOCAB = 4096, 8192, 24, 32000
HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a CUDA device of compute capability 9.0 or later (Hopper)",
)


@pytest.fixture
def pdl_switch() -> Iterator[Callable[[bool], None]]:
    yield set_pdl
    set_pdl(True)


def test_cpu_tensors_never_launch_early() -> None:
    assert not launches_early(torch.zeros(1))


@triton.jit
def _late_copy_kernel(src_ptr, dst_ptr, n, DELAY_NS: tl.constexpr, BLOCK: tl.constexpr):
    """dst <- src, DELAY_NS after starting; dependents may launch at once."""
    gdc_launch_dependents()
    start = globaltimer()
    now = start
    while now - start < DELAY_NS:
        now = globaltimer()
    for offset in range(0, n, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        tl.store(dst_ptr + cols, tl.load(src_ptr + cols, mask=cols < n), mask=cols < n)


def _late(src: torch.Tensor) -> torch.Tensor:
    """A copy of src written 200 us into a kernel that lets the next one start at once; NaN
    (or zeros, for integers) until then."""
    dst = torch.full_like(src, float("nan") if src.is_floating_point() else 0)
    _late_copy_kernel[(1,)](src, dst, src.numel(), DELAY_NS=200_000, BLOCK=4096)
    return dst


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@HOPPER
def test_each_pdl_kernel_waits_for_the_input_written_late() -> None:
    assert launches_early(torch.zeros(1, device="cuda"))
    x, weight = _bf16(3, HIDDEN, seed=1), _bf16(HIDDEN, seed=2)
    _close(ops.rms_norm(_late(x), weight, 1e-5), rms_norm_reference(x, weight, 1e-5))
    residual = _bf16(3, HIDDEN, seed=3)
    got = ops.fused_add_rms_norm(x.clone(), _late(residual), weight, 1e-5)
    for g, w in zip(got, fused_add_rms_norm_reference(x, residual, weight, 1e-5), strict=True):
        _close(g, w)
    gate_up = _bf16(2, 2 * INTER, seed=4)
    _close(ops.silu_and_mul(_late(gate_up)), ops.silu_and_mul(gate_up))
    w_up = _bf16(INTER, HIDDEN, seed=5) * HIDDEN**-0.5
    _close(ops.linear(_late(x[:1]), w_up), x[:1].float() @ w_up.float().t())
    qweight, scale = quantize_fp8_rowwise_reference(w_up)
    got = quantized_ops.fp8_linear(_late(x[:2]), qweight, scale[:, 0].contiguous())
    _close(got, fp8_linear_reference(x[:2], qweight, scale[:, 0].contiguous()))
    qweight, scales, zeros = quantize_int4_reference(w_up.float(), 128, symmetric=False)
    scales = scales.to(torch.bfloat16)
    for rows in (1, 32):  # the int4 dot kernel's tiles of 8 rows (split along K) and of 32
        h = _bf16(rows, HIDDEN, seed=8)
        got = quantized_ops.int4_linear(_late(h), qweight, scales, zeros, 128)
        _close(got, int4_linear_reference(h, qweight, scales, zeros, 128))
    logits = _bf16(2, VOCAB, seed=6).float()
    assert torch.equal(ops.argmax(_late(logits)), argmax_reference(logits))
    input_ids = torch.zeros(4, dtype=torch.int32, device="cuda")
    source_rows = torch.tensor([1, -1, 0, 2], dtype=torch.int32, device="cuda")
    sampled = torch.tensor([7, 8, 9], dtype=torch.int64, device="cuda")
    ops.gather_sampled_inputs(input_ids, _late(source_rows), sampled)
    assert input_ids.tolist() == [8, 0, 7, 9]
    table = _bf16(VOCAB // 2, HIDDEN, seed=7)
    ids = torch.tensor([3, VOCAB // 2 + 5, VOCAB - 1], device="cuda")
    got = ops.embedding_rows(_late(ids), table, VOCAB // 2)
    assert torch.equal(got, embedding_rows_reference(ids, table, VOCAB // 2))


def _chain_output(rows: int) -> torch.Tensor:
    """Replays the chain's graph three times: the last hidden rows and tokens."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * k**-0.5

    layers = []
    for i in range(LAYERS):
        up, down = weight(2 * INTER, HIDDEN), weight(HIDDEN, INTER)
        if i % 2:  # FP8 layers: per-channel scales, the activations quantized per token
            up, down = (quantize_fp8_rowwise_reference(w) for w in (up, down))
        norm_weight = (torch.rand(HIDDEN, generator=gen, device="cuda") + 0.5).to(torch.bfloat16)
        layers.append((norm_weight, up, down))
    lm_head = weight(VOCAB, HIDDEN)
    x = torch.randn(rows, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16)

    def project(h: torch.Tensor, w: torch.Tensor | tuple[torch.Tensor, torch.Tensor]):
        if isinstance(w, tuple):
            return quantized_ops.fp8_linear(h, w[0], w[1][:, 0].contiguous())
        return ops.linear(h, w)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = x.clone(), torch.zeros_like(x)
        for norm_weight, up, down in layers:
            normed, residual = ops.fused_add_rms_norm(hidden, residual, norm_weight, 1e-5)
            hidden = project(ops.silu_and_mul(project(normed, up)), down)
        final = ops.rms_norm(hidden + residual, layers[0][0], 1e-5)
        return final, ops.argmax(ops.linear(final, lm_head).float())

    step()  # compiles every kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        final, tokens = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return torch.cat([final.float().flatten(), tokens.float()]).cpu()


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("rows", [1, 8])
def test_the_chain_gives_the_same_bits_with_and_without_pdl(
    rows: int, pdl_switch: Callable[[bool], None]
) -> None:
    with_pdl = _chain_output(rows)
    pdl_switch(False)
    assert not launches_early(torch.zeros(1, device="cuda"))
    assert torch.equal(with_pdl, _chain_output(rows))
    pdl_switch(True)
    assert torch.equal(with_pdl, _chain_output(rows))
