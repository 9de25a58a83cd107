"""CUDA graphs of the decode forward pass, one per padded batch size.

A decode step of a large model is a few hundred kernel launches of a few microseconds each;
launched one by one from Python, the host is the bottleneck and the GPU idles. A graph
replays the whole forward pass with one launch. Graphs have fixed shapes and addresses, so
batches are padded up to the next captured size, and every input is read from the fixed
offsets of `StepBuffers` (padding rows read block 0 and write no KV).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from services.executor.step_buffers import StepBuffers, StepView

logger = logging.getLogger(__name__)

Forward = Callable[[StepView], torch.Tensor]  # -> hidden states [T, hidden]


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, then every 16, capped at max_batch (included)."""
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, forward: Forward, buffers: StepBuffers, max_batch: int, max_seq_len: int):
        self.forward = forward
        self.buffers = buffers
        self.max_seq_len = max_seq_len  # attention's context bound, fixed at capture
        self.sizes = graph_batch_sizes(min(max_batch, buffers.max_reqs, buffers.max_tokens))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def padded_size(self, num_reqs: int, num_tokens: int) -> int | None:
        """The captured size a step runs at, or None if it is no pure decode that fits."""
        if num_tokens != num_reqs or num_reqs > self.sizes[-1]:
            return None
        return next(s for s in self.sizes if s >= num_reqs)

    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        # Largest first: smaller graphs then reuse its memory from the shared pool.
        for size in reversed(self.sizes):
            self.buffers.write([], [], [], [], pad_to=size)
            self.buffers.copy_to_device()
            view = self.buffers.view(self.max_seq_len)
            self.forward(view)  # warm-up outside the graph: Triton compiles, cuBLAS picks
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.forward(view)
            pool = graph.pool()
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs for decode batches of %d..%d in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` on what the buffers hold; hidden states [size, hidden]."""
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden
