"""Programmatic dependent launch (kernels.triton_pdl) changes when kernels start, never a value.

A chain of dependent decode kernels (RMSNorm, skinny linear layers in bf16 and FP8, the FP8
quantization, SiLU-and-mul, argmax) is captured in a CUDA graph and replayed, once in a process
with PDL and once with KVFLOW_PDL=0 (the switch is read once per process). A kernel that read
its input before the one producing it had finished would give other bits; the two runs must
agree exactly, since PDL changes no arithmetic.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from kernels.triton_pdl import launches_early

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, INTER, LAYERS, VOCAB = 4096, 8192, 24, 32000


def test_cpu_tensors_never_launch_early() -> None:
    assert not launches_early(torch.zeros(1))


def write_chain_output(path: str, rows: int) -> None:
    """Replays the chain's graph three times and writes the last hidden rows and tokens."""
    from kernels import ops
    from kernels.fp8 import quantize_fp8_rowwise_reference

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
            return ops.fp8_linear(h, w[0], w[1][:, 0].contiguous())
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
    out = torch.cat([final.float().flatten(), tokens.float()])
    out.cpu().numpy().tofile(path)


def _chain(tmp_path: Path, pdl: str, rows: int) -> bytes:
    path = tmp_path / f"chain_pdl{pdl}_{rows}.bin"
    code = (
        "import sys; from tests.kernels.test_triton_pdl import write_chain_output; "
        "write_chain_output(sys.argv[1], int(sys.argv[2]))"
    )
    env = {**os.environ, "KVFLOW_PDL": pdl}
    subprocess.run(
        [sys.executable, "-c", code, str(path), str(rows)], cwd=ROOT, env=env, check=True
    )
    return path.read_bytes()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a CUDA device of compute capability 9.0 or later (Hopper)",
)
@pytest.mark.parametrize("rows", [1, 8])
def test_the_chain_gives_the_same_bits_with_and_without_pdl(tmp_path: Path, rows: int) -> None:
    assert launches_early(torch.zeros(1, device="cuda"))
    with_pdl = _chain(tmp_path, "1", rows)
    assert with_pdl == _chain(tmp_path, "0", rows)
    assert with_pdl == _chain(tmp_path, "1", rows)
