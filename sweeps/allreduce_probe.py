"""What one all-reduce of a decode step's hidden states costs between the GPUs of one host:
NCCL through torch.distributed eagerly and inside a CUDA graph, and torch's symmetric-memory
one-shot all-reduce (peer-to-peer loads, no NVLink multicast) inside a graph.

    python3 -m torch.distributed.run --nproc-per-node 2 sweeps/allreduce_probe.py OUT.json

Sizes are rows of Llama-3.1-8B's hidden size (4096, bf16): 1 row is batch-1 decode. A graph
holds 64 all-reduces (two per layer of 32 layers), as a decode step does.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

HIDDEN = 4096
ROWS = (1, 8, 32, 128)
PER_GRAPH = 64
REPLAYS = 50


def timed(fn, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / repeats  # µs


def in_graph(step) -> float:
    """µs per all-reduce, PER_GRAPH of them captured in one graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(PER_GRAPH):
            step()
    return timed(graph.replay, REPLAYS) / PER_GRAPH


def main() -> None:
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    results: dict[str, dict[int, float | str]] = {}

    def record(name: str, rows: int, fn) -> None:
        try:
            results.setdefault(name, {})[rows] = round(fn(), 2)
        except Exception as exc:  # a method this torch or machine lacks: say so, go on
            results.setdefault(name, {})[rows] = f"{type(exc).__name__}: {exc}"[:300]

    for rows in ROWS:
        x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device=device)
        record("nccl_eager", rows, lambda x=x: timed(lambda: dist.all_reduce(x), 200))
        record("nccl_graph", rows, lambda x=x: in_graph(lambda: dist.all_reduce(x)))

        def symm(rows: int = rows) -> float:
            import torch.distributed._symmetric_memory as symm_mem

            group = dist.group.WORLD.group_name
            buf = symm_mem.empty(rows, HIDDEN, dtype=torch.bfloat16, device=device)
            symm_mem.rendezvous(buf, group)
            out = torch.empty_like(buf)
            op = torch.ops.symm_mem.one_shot_all_reduce_out
            return in_graph(lambda: op(buf, "sum", group, out))

        record("symm_mem_one_shot_graph", rows, symm)
    check = torch.full((4, HIDDEN), float(rank + 1), dtype=torch.bfloat16, device=device)
    dist.all_reduce(check)
    results["check_sum"] = {0: float(check[0, 0])}
    if rank == 0:
        print(json.dumps(results, indent=1))
        if len(sys.argv) > 1:
            with open(sys.argv[1], "w") as f:
                json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
