"""Whether decode steps of up to INVARIANT_MAX_ROWS query rows compute each row the same way
whatever the step's row count (`--batch-invariant`). Then a row verifying k drafts computes
each of its k + 1 tokens as a one-token decode step would, so greedy speculative decoding at
batch 1 gives the tokens that decoding without it gives, on the GPU too (on the CPU the torch
paths are row-invariant already).

What it changes, all in Triton:
- the skinny linear layer takes its tensor-core tiles at one row too (`kernels.triton_linear`),
  whose per-row sums do not depend on the other rows of the 16-row tile;
- the split-KV decode kernel cuts every context into splits of a fixed length
  (`kernels.triton_decode_attention`), so that a query's splits depend on its own position,
  not on the step's longest context or its number of requests, and pads a request's (query,
  head) pairs to one shape, so that each row's sums are reduced by the same threads;
- RMSNorm packs as many rows into a program whatever the row count (`kernels.triton_norm`),
  so that a row's sum of squares takes one reduction order.

The executor sets it from the flag; it lives apart from the Triton modules so that processes
on the CPU set it without importing Triton.
"""

from __future__ import annotations

INVARIANT_MAX_ROWS = 16  # the row tile of the skinny linear layer's tensor-core path

_enabled = False


def set_batch_invariant(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def batch_invariant(rows: int) -> bool:
    """Whether a step of `rows` query rows runs the invariant path."""
    return _enabled and rows <= INVARIANT_MAX_ROWS


def batch_invariant_on() -> bool:
    """Whether the flag is on: for kernels whose launch shape must not follow the row count at
    all (a norm over each head of each token sees heads x tokens rows)."""
    return _enabled
