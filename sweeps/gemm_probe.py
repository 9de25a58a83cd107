"""The linear layers of a large decode batch (128-512 rows): cuBLAS against plain Triton tiles.

`offline` (issue 9) spends about half its decode steps in these GEMMs, which sit near the
ridge between compute and memory at 256 rows, and where the N = 4096 projections give few
output tiles for 132 SMs. For each shape of --model at each M in --m: torch's F.linear with
cuBLAS and with cuBLASLt (`torch.backends.cuda.preferred_blas_library`), and two Triton GEMMs
(below, probes only: no engine path uses them), in TFLOP/s, timed as `linear_sweep.py` times
them (a CUDA graph over one weight copy per layer, from HBM):

- "triton": a plain tiled GEMM at each config in CONFIGS;
- "tma": out^T = W x^T with both tiles brought by Hopper's tensor memory accelerator and K
  split among programs (kernels/triton_split_k.py), at each config in TMA_CONFIGS (the best
  of a wider sweep on an H200, 2026-11-28: docs/benchmarks-history.md).

    python -m sweeps.gemm_probe --model qwen3 --m 128 256 512 --out $OUT/gemm_probe.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import triton_split_k as split_k
from kernels.triton_split_k import sum_of_splits
from sweeps.linear_sweep import (
    MODEL_LAYERS,
    MODEL_SHAPES,
    make_input,
    make_weights,
    rel_error,
    time_layer,
)

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
CONFIGS = [
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (64, 256, 64, 8, 4),
    (64, 64, 64, 4, 5),
    (256, 128, 64, 8, 3),
]

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) of the TMA kernel
TMA_CONFIGS = [
    (128, 64, 128, 4, 3, 1),
    (128, 64, 128, 4, 3, 2),
    (128, 128, 64, 8, 4, 1),
    (128, 128, 128, 8, 3, 2),
    (128, 128, 128, 8, 3, 4),
    (128, 256, 64, 8, 4, 1),
    (256, 64, 64, 8, 4, 2),
    (256, 128, 64, 8, 4, 1),
]


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[M, N] = x[M, K] @ w[N, K]^T, one output tile a program, the M tiles of one weight
    tile next to each other (they share it in L2)."""
    num_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    pid_m, pid_n = pid % num_m, pid // num_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None] * K + ks[None, :]
    w_tile = w_ptr + cols[:, None] * K + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(x_tile, mask=rows[:, None] < M, other=0.0)
        b = tl.load(w_tile, mask=cols[:, None] < N, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    out = out_ptr + rows[:, None] * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def triton_linear(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
    block_m, block_n, block_k, warps, stages = config
    (m, k), n = x.shape, w.shape[0]
    assert k % block_k == 0
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](
        x, w, out, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@triton.jit
def _gemm_tma_kernel(
    x_desc, w_desc, out_ptr, partials_ptr, tickets_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):  # fmt: skip
    """out[rows, cols]^T = W[cols] x[rows]^T over this program's share of K: the weight tile
    is the first operand (64-row MMAs along N, so a tile may hold all of a decode batch's
    rows), both tiles come by TMA; the last split to finish adds the partials."""
    off_n = tl.program_id(0) * BLOCK_N
    off_m = tl.program_id(1) * BLOCK_M
    k_share = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_begin = tl.program_id(2) * k_share
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_begin, tl.minimum(k_begin + k_share, K), BLOCK_K):
        acc = tl.dot(w_desc.load([off_n, k]), tl.trans(x_desc.load([off_m, k])), acc)
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    mask = (cols[:, None] < N) & (rows[None, :] < M)
    if SPLIT_K > 1:
        acc, last = sum_of_splits(acc, partials_ptr, tickets_ptr, rows, cols, mask, M, N, SPLIT_K)
        if not last:
            return
    out = out_ptr + rows[None, :] * N + cols[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def tma_linear(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
    block_m, block_n, block_k, warps, stages, split = config
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    partials, tickets = split_k.workspace(grid, m, n, out, config)
    _gemm_tma_kernel[grid](
        TensorDescriptor.from_tensor(x, [block_m, block_k]),
        TensorDescriptor.from_tensor(w, [block_n, block_k]),
        out, partials, tickets, m, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="qwen3")
    parser.add_argument("--m", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dtype = torch.bfloat16
    rows: list[dict[str, Any]] = []
    for shape in MODEL_SHAPES[args.model]:
        weights = make_weights([shape], MODEL_LAYERS[args.model], dtype, seed=0)[shape.name]
        for m in args.m:
            x = make_input(shape, m, dtype, seed=1)
            expected = F.linear(x, weights[0])
            flop = 2 * m * shape.n * shape.k
            default = torch.backends.cuda.preferred_blas_library()
            for library in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(library)
                seconds = time_layer(lambda x, w: F.linear(x, w), x, weights)
                rows.append(_row(shape.name, m, library, seconds, flop))
            torch.backends.cuda.preferred_blas_library(default)
            probes: list[tuple[str, Callable[..., torch.Tensor], tuple[int, ...]]]
            probes = [("triton m{} n{} k{} w{} s{}", triton_linear, c) for c in CONFIGS]
            probes += [("tma m{} n{} k{} w{} s{} split{}", tma_linear, c) for c in TMA_CONFIGS]
            for label, linear, config in probes:
                name = label.format(*config)
                try:
                    err = rel_error(linear(x, weights[0], config), expected)
                    if err > 2e-2:
                        raise ValueError(f"relative error {err:.3g}")
                    seconds = time_layer(lambda x, w, f=linear, c=config: f(x, w, c), x, weights)
                except Exception as exc:  # a config that does not fit is skipped
                    print(f"{shape.name} m{m} {name}: skipped ({exc})"[:200], flush=True)
                    continue
                rows.append(_row(shape.name, m, name, seconds, flop))
        del weights
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))


def _row(shape: str, m: int, kernel: str, seconds: float, flop: int) -> dict[str, Any]:
    row = {"shape": shape, "m": m, "kernel": kernel, "us": round(seconds * 1e6, 2)}
    row["tflops"] = round(flop / seconds / 1e12, 1)
    print(row, flush=True)
    return row


if __name__ == "__main__":
    main()
