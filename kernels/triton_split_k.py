"""Split-K for the weight-streaming GEMVs (int4, FP8): SPLIT_K programs share an output tile's
K steps, each writes its float32 partial sum, and the last to finish, told by a ticket counter,
adds them. A narrow layer has too few output tiles to fill the GPU, and each would walk all of K.

The last program adds the partials in split order, so the sum is the same whichever finishes
last, and it sets the tile's counter back to zero: the counters stay zero between launches, so
CUDA graphs replay them as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TICKETS = 1 << 16  # output tiles a split-K launch may have (the ticket counters)

_TICKETS: dict[torch.device, torch.Tensor] = {}


def tickets(device: torch.device, count: int = MAX_TICKETS, what: object = "") -> torch.Tensor:
    """The split-K ticket counters of a device, shared by every kernel that splits its work
    (the GEMVs' K, decode attention's context: kernels/triton_decode_attention.py); kernels on
    one stream run one after another, and with PDL the next waits before it takes a ticket.
    Made zero once, outside a graph capture (whose zero fill would not run until the first
    replay): the engine's eager warm-up calls every layer first."""
    if device not in _TICKETS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K: run the layer once before capturing a CUDA graph")
        _TICKETS[device] = torch.zeros(MAX_TICKETS, dtype=torch.int32, device=device)
    if count > MAX_TICKETS:
        raise ValueError(f"{what}: {count} ticket counters wanted, there are {MAX_TICKETS}")
    return _TICKETS[device]


def workspace(
    grid: tuple[int, int, int],  # (output tiles along N, along M, splits of K), or M then N
    m: int,
    n: int,
    unused: torch.Tensor,  # passed for both where K is not split (the kernel reads neither)
    what: object,  # the launch's tiles, for the error
) -> tuple[torch.Tensor, torch.Tensor]:  # (SPLIT_K * M * N float32 partials, tickets)
    """What a launch over `grid` needs to split K: a float32 partial sum per split ([SPLIT_K,
    M, N]; a kernel may index it as [SPLIT_K, N, M]) and the device's ticket counters, one per
    output tile."""
    if grid[2] == 1:
        return unused, unused
    counters = tickets(unused.device, grid[0] * grid[1], what)  # one per output tile
    partials = torch.empty((grid[2], m, n), dtype=torch.float32, device=unused.device)
    return partials, counters


@triton.jit
def last_to_arrive(ticket_ptr, count):
    """Whether this program is the last of `count` to take a ticket at ticket_ptr: every
    thread's stores before are visible to it, and its loads after see every other program's
    (acquire-release at GPU scope). The last one sets the counter back to zero when done."""
    tl.debug_barrier()  # every thread's stores made before the ticket is taken
    last = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu") == count - 1
    tl.debug_barrier()
    return last


@triton.jit
def sum_of_splits(
    acc,  # [BN, BM] float32: this program's partial sum, weight rows by rows of x
    partials_ptr,  # [SPLIT_K, M, N] float32
    tickets_ptr,  # [output tiles] int32, zero between launches
    rows,  # [BM] rows of x
    cols,  # [BN] weight rows (output columns)
    mask,  # [BN, BM]
    m,
    n,
    SPLIT_K: tl.constexpr,
):
    """(the tile's whole sum, True) for the last program of the tile to finish; (its own
    partial, False) for the others, which have nothing left to write."""
    split = tl.program_id(2)
    partial_ptrs = partials_ptr + (split * m + rows[None, :]) * n + cols[:, None]
    tl.store(partial_ptrs, acc, mask=mask)
    ticket_ptr = tickets_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    last = last_to_arrive(ticket_ptr, SPLIT_K)
    if last:
        acc = tl.zeros_like(acc)
        for other in tl.static_range(SPLIT_K):  # in split order: the same sum every time
            other_ptrs = partials_ptr + (other * m + rows[None, :]) * n + cols[:, None]
            acc += tl.load(other_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(ticket_ptr, 0)
    return acc, last


__all__ = ["MAX_TICKETS", "last_to_arrive", "sum_of_splits", "tickets", "workspace"]
