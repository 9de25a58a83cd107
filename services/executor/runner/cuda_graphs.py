"""CUDA graphs of the forward pass: decode and verifying batches by size, mixed steps by
token count.

A forward pass of a large model is a few hundred kernel launches of a few microseconds each;
launched one by one from Python, the host is the bottleneck and the GPU idles. A graph
replays the whole forward pass with one launch. Graphs have fixed shapes and addresses, so
steps are padded up to the next captured shape, and every input is read from the fixed
offsets of `StepBuffers`:
- decode graphs (one token per request, the split-KV decode attention), by batch size;
  padding rows read block 0 and write no KV;
- with speculative decoding, verifying graphs by batch size: up to 1 + num_speculative_tokens
  tokens a request, which the decode kernel attends too (a row's tokens share its programs);
  padded as mixed steps are;
- mixed graphs (prompts or chunks beside decodes, the prefill attention, whose launch
  depends on shapes only), by token count up to MIXED_GRAPH_MAX_TOKENS; padding tokens
  belong to no request and padding requests have no tokens. Larger steps run eagerly: there
  the device's work outlasts the launches anyway.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator

import torch

from services.executor.runner.step_buffers import PaddedShape, StepBuffers, StepView

logger = logging.getLogger(__name__)

Forward = Callable[[StepView], torch.Tensor]  # -> hidden states [T, hidden]

MIXED_GRAPH_MAX_TOKENS = 512
DECODE_GRAPH_MAX_BATCH = 512  # larger decode steps run eagerly (as vLLM's default capture)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, then every 16 up to 512, capped at max_batch
    (included). Past 512 rows steps run eagerly, as past vLLM's default capture sizes: one
    graph at max_batch padded a step of 513 rows to --max-num-seqs (1024: twice the work).
    Eager against padded at those sizes is not measured."""
    limit = min(max_batch, DECODE_GRAPH_MAX_BATCH)
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, DECODE_GRAPH_MAX_BATCH + 1, 16)]
    return sorted({s for s in sizes if s < limit} | {limit})


def mixed_token_sizes(max_tokens: int) -> list[int]:
    """16, then every 16 up to 64, every 32 up to 256, every 64 up to 512; capped."""
    sizes = [*range(16, 64, 16), *range(64, 256, 32), *range(256, 513, 64)]
    limit = min(max_tokens, MIXED_GRAPH_MAX_TOKENS)
    return sorted({s for s in sizes if s < limit} | {limit})


class StepGraphs:
    def __init__(
        self,
        forward: Forward,
        buffers: StepBuffers,
        max_batch: int,
        max_seq_len: int,
        mixed: bool = True,
        name: str = "",
        before_capture: Callable[[PaddedShape], None] | None = None,
    ) -> None:
        """`mixed`: capture mixed steps too (else decode batches only); `name`: for the log
        (the target's: none); `before_capture`: called with each shape before each of its
        runs at capture (the warm-up, the capture)."""
        self.name = name
        self.before_capture = before_capture
        self.forward = forward
        self.buffers = buffers
        self.max_seq_len = max_seq_len  # attention's context bound, fixed at capture
        self.max_reqs = min(max_batch, buffers.max_reqs)
        self.decode_sizes = graph_batch_sizes(min(self.max_reqs, buffers.max_tokens))
        self.mixed_sizes = mixed_token_sizes(buffers.max_tokens) if mixed else []
        # A verifying step in a mixed graph would pad its requests to the token count, and the
        # decode kernel's split-KV count follows the requests: at batch 1, 5 splits where a
        # decode takes up to 64 (an 8,192-token context's verifying step 1.48x a decode's).
        self.queries = buffers.decode_queries if mixed else 1
        verify_limit = min(buffers.max_tokens, MIXED_GRAPH_MAX_TOKENS) // self.queries
        verifies = self.queries > 1
        self.verify_sizes = [s for s in self.decode_sizes if verifies and s <= verify_limit]
        self.graphs: dict[PaddedShape, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.round_sizes = sorted({*self.decode_sizes, *self.mixed_sizes})  # `rows_for`'s

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return device.type == "cuda"

    def shape_for(self, num_reqs: int, num_tokens: int, max_query_len: int) -> PaddedShape | None:
        """The captured shape a step (its most tokens a request: `max_query_len`) runs at, or
        None if it runs eagerly."""
        if max_query_len == 1 and num_reqs <= self.decode_sizes[-1]:
            return self._decode(self.decode_sizes[bisect.bisect_left(self.decode_sizes, num_reqs)])
        verify = self.verify_sizes
        if max_query_len <= self.queries and verify and num_reqs <= verify[-1]:
            return self._verify(verify[bisect.bisect_left(verify, num_reqs)])
        if self.mixed_sizes and num_tokens <= self.mixed_sizes[-1]:
            return self._mixed(self.mixed_sizes[bisect.bisect_left(self.mixed_sizes, num_tokens)])
        return None

    def rows_for(self, num_tokens: int, mixed: bool = False) -> int:
        """The rows a step of `num_tokens` is padded to across replicas: those of the smallest
        graph that holds it (a mixed step's with `mixed`: some replica's step is mixed; else
        decode or mixed), or its own past them. Every replica's graphs alike, each finds the
        same for the most rows any replica runs."""
        sizes = self.mixed_sizes if mixed and self.mixed_sizes else self.round_sizes
        return (
            sizes[bisect.bisect_left(sizes, num_tokens)] if num_tokens <= sizes[-1] else num_tokens
        )

    def shape_at(self, num_tokens: int, max_query_len: int) -> PaddedShape | None:
        """The captured shape of exactly `num_tokens` tokens that a step (its most tokens a
        request: `max_query_len`, 0 with none) runs at across replicas, if there is one."""
        if max_query_len <= 1 and num_tokens in self.decode_sizes:
            return self._decode(num_tokens)
        return self._mixed(num_tokens) if num_tokens in self.mixed_sizes else None

    def _decode(self, size: int) -> PaddedShape:
        return PaddedShape(size, size, max_query_len=1)

    def _verify(self, size: int) -> PaddedShape:
        return PaddedShape(size * self.queries, size, max_query_len=self.queries)

    def _mixed(self, size: int) -> PaddedShape:
        # Every request has a token, so min(size, max_reqs) requests hold any step.
        return PaddedShape(size, min(size, self.max_reqs), max_query_len=size)

    def _shapes(self) -> list[PaddedShape]:
        decode, verify, mixed = self.decode_sizes, self.verify_sizes, self.mixed_sizes
        return [*map(self._decode, decode), *map(self._verify, verify), *map(self._mixed, mixed)]

    def capture(self) -> None:
        start = time.perf_counter()
        with _garbage_collected_first():
            self._capture_each()
        torch.cuda.synchronize()
        self._log_captured(time.perf_counter() - start)

    def _capture_each(self) -> None:
        pool = None
        # Largest first: smaller graphs then reuse its memory from the shared pool.
        for shape in sorted(self._shapes(), key=lambda s: -s.num_tokens):
            self._before(shape)
            self.buffers.write([], [], [], [], pad_to=shape)
            self.buffers.copy_to_device()
            # A decode or verifying graph runs the decode kernel; a mixed one the prefill
            # kernel too, with tiles for queries as long as the whole step.
            view = self.buffers.view(self.max_seq_len, shape.max_query_len)
            self.forward(view)  # warm-up outside the graph: Triton compiles, cuBLAS picks
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            self._before(shape)  # again: the graph must make what the warm-up made and kept
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.forward(view)
            pool = graph.pool()
            self.graphs[shape] = (graph, hidden)

    def _before(self, shape: PaddedShape) -> None:
        if self.before_capture is not None:
            self.before_capture(shape)

    def _log_captured(self, seconds: float) -> None:
        kinds = [f"decode batches of {self.decode_sizes[0]}..{self.decode_sizes[-1]}"]
        if self.verify_sizes:
            sizes = self.verify_sizes
            kinds.append(f"verifying batches of {sizes[0]}..{sizes[-1]} (<= {self.queries} tokens)")
        if self.mixed_sizes:
            kinds.append(f"mixed steps of {self.mixed_sizes[0]}..{self.mixed_sizes[-1]} tokens")
        logger.info(
            "captured %d CUDA graphs%s in %.1f s: %s",
            len(self.graphs),
            f" of {self.name}" if self.name else "",
            seconds,
            ", ".join(kinds),
        )

    def replay(self, shape: PaddedShape) -> torch.Tensor:
        """Run the graph of `shape` on what the buffers hold; hidden states [T, hidden]."""
        graph, hidden = self.graphs[shape]
        graph.replay()
        return hidden


@contextlib.contextmanager
def _garbage_collected_first() -> Iterator[None]:
    """Collect garbage before capturing, and none while capturing: a collection that frees an
    earlier engine's graphs destroys them mid-capture, which CUDA forbids and which invalidates
    the capture (seen on an H200: a second engine in one process failed its capture in cuBLAS).
    torch.cuda.graph no longer collects by itself (torch.compiler.config.force_cudagraph_gc)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
