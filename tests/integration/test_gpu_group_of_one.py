"""The NCCL code path on one GPU: a tensor-parallel group of one joins as the ranks of a larger
group join (`join_world`), and a collective on it, eagerly and captured in a CUDA graph as the
decode graphs capture theirs, leaves the tensor as it was. Run in a process of its own, so
that the default process group it makes does not outlive the test."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from services.executor.parallel.world import join_world
from shared.config import Config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def join_and_reduce() -> None:
    import torch.distributed as dist

    config = Config(device="cuda", tensor_parallel_size=1)
    directory = Path(tempfile.mkdtemp(dir=os.environ["GROUP_DIR"]))
    tp = join_world(config, 0, directory, torch.device("cuda", 0))
    assert dist.get_backend() == "nccl" and (tp.rank, tp.size) == (0, 1)
    x = torch.arange(8.0, device="cuda")
    dist.all_reduce(x)  # TensorParallel skips collectives at size 1: call NCCL itself
    graph, captured = torch.cuda.CUDAGraph(), torch.zeros(8, device="cuda")
    dist.all_reduce(captured)  # once before the capture, as the decode graphs are warmed up
    with torch.cuda.graph(graph):
        captured.add_(1.0)
        dist.all_reduce(captured)
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == list(range(8)) and captured.tolist() == [1.0] * 8
    dist.destroy_process_group()
    print("group of one: ok")


def test_an_nccl_group_of_one_joins_and_its_collectives_run_in_graphs(tmp_path: Path) -> None:
    code = "from tests.integration.test_gpu_group_of_one import join_and_reduce; join_and_reduce()"
    env = {**os.environ, "GROUP_DIR": str(tmp_path)}  # where the group meets: removed after
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "group of one: ok" in done.stdout
