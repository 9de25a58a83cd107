"""The fused all-reduce + residual add + RMSNorm between two GPUs, over symmetric memory
(kernels/triton_all_reduce_norm.py), against NCCL's all-reduce followed by the fused add and
norm: eagerly, for row counts from 1 to the most the buffers take, and captured in a CUDA graph
that replays a layer stack's worth of calls; and the logits all-gather over symmetric memory
(kernels/triton_all_gather.py) against NCCL's. Each rank runs in a process of its own."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.all_reduce_norm import reduce_takes
from services.executor.parallel.symmetric_memory import MAX_GATHER_ROWS, with_peer_buffers
from services.executor.parallel.tensor_parallel import TensorParallel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
HIDDEN, VOCAB_PART, EPS = 4096, 64128, 1e-5


def check_rank(rank: int, directory: str) -> None:
    import torch.distributed as dist

    from kernels import ops
    from services.executor.parallel.symmetric_memory import MAX_FUSED_ROWS
    from services.executor.parallel.world import join_world
    from shared.config import Config

    tp = join_world(
        Config(device="cuda", tensor_parallel_size=2),
        rank,
        Path(directory),
        torch.device("cuda", rank),
    )
    tp = with_peer_buffers(tp, HIDDEN, VOCAB_PART, torch.bfloat16, torch.device("cuda", rank))
    assert tp.reduce_peers is not None, "no symmetric memory between the two GPUs"
    gen = torch.Generator(device="cuda").manual_seed(7)  # the same draws on both ranks
    weight = torch.rand(HIDDEN, generator=gen, device="cuda").to(torch.bfloat16) + 0.5

    def draws(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Both ranks' partials (this rank takes its own) and the shared residual."""
        parts = torch.randn(2, rows, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
        residual = torch.randn(rows, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
        return parts[rank].contiguous(), residual

    for rows in (1, 3, 64, 1, MAX_FUSED_ROWS):  # slots used unevenly, then all of them
        partial, residual = draws(rows)
        assert reduce_takes(tp.reduce_peers, partial)
        calls = tp.reduce_peers.epochs[:rows].clone()
        want = ops.fused_add_rms_norm(tp.all_reduce(partial.clone()), residual.clone(), weight, EPS)
        got = tp.all_reduce_add_rms_norm(partial, residual.clone(), weight, EPS)
        assert torch.equal(tp.reduce_peers.epochs[:rows], calls + 1)  # the fused kernel ran
        for g, w in zip(got, want, strict=True):  # NCCL adds two bf16 values as floats too
            assert torch.equal(g, w), (rows, (g.float() - w.float()).abs().max().item())

    for rows in (1, 5):  # the model's first norm: nothing to add, the sum becomes the residual
        partial, _ = draws(rows)
        summed = tp.all_reduce(partial.clone())
        calls = tp.reduce_peers.epochs[:rows].clone()
        got = tp.all_reduce_add_rms_norm(partial, None, weight, EPS)
        assert torch.equal(tp.reduce_peers.epochs[:rows], calls + 1)  # the fused kernel ran
        assert torch.equal(got[1], summed)
        assert torch.equal(got[0], ops.rms_norm(summed, weight, EPS))

    # A stack of layers in a graph, each call's output feeding the next; the graph's input
    # stays x0 and the residual carries on from replay to replay.
    x0, residual0 = draws(8)
    x_in, residual = x0.clone(), residual0.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x = x_in
        for _ in range(64):
            x, _ = tp.all_reduce_add_rms_norm(x * 0.5, residual, weight, EPS)
    expected_res = residual0.clone()
    calls = tp.reduce_peers.epochs[:8].clone()
    for replay in range(3):
        expected_x = x0
        for _ in range(64):
            expected_x, expected_res = ops.fused_add_rms_norm(
                tp.all_reduce(expected_x * 0.5), expected_res, weight, EPS
            )
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(x, expected_x) and torch.equal(residual, expected_res), replay
    assert torch.equal(tp.reduce_peers.epochs[:8], calls + 3 * 64)  # the graph holds the kernel
    check_gather(tp, gen)
    dist.destroy_process_group()
    print(f"rank {rank}: ok")


def check_gather(tp: TensorParallel, gen: torch.Generator) -> None:
    """The logits all-gather over the peers' buffers gives NCCL's all-gather, up to the rows
    the buffers take (past them NCCL serves)."""
    assert tp.gather_peers is not None
    nccl = dataclasses.replace(tp, gather_peers=None)
    for rows in (1, 3, MAX_GATHER_ROWS, 1, MAX_GATHER_ROWS + 1):
        parts = torch.randn(2, rows, VOCAB_PART, generator=gen, device="cuda")
        part = parts[tp.rank].to(torch.bfloat16)
        calls = tp.gather_peers.epochs.clone()
        got = tp.all_gather(part)
        assert torch.equal(got, nccl.all_gather(part)), rows
        assert torch.equal(got, torch.cat(list(parts.to(torch.bfloat16)), dim=-1)), rows
        ran = not torch.equal(tp.gather_peers.epochs, calls)
        assert ran == (rows <= MAX_GATHER_ROWS), rows


def test_two_ranks_reduce_add_and_norm_as_nccl_and_the_norm_do(tmp_path: Path) -> None:
    code = "import sys; from tests.integration.test_gpu_fused_all_reduce import check_rank; "
    code += "check_rank(int(sys.argv[1]), sys.argv[2])"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ},
        )
        for rank in range(2)
    ]
    try:
        for rank, process in enumerate(ranks):
            out, err = process.communicate(timeout=300)
            assert process.returncode == 0, err[-3000:]
            assert f"rank {rank}: ok" in out
    finally:  # a rank left waiting for its peer would spin on its GPU for good
        for process in ranks:
            process.kill()
