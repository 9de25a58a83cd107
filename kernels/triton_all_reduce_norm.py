"""The all-reduce after a row-parallel layer, fused with the residual add and the RMSNorm after it.

With tensor parallelism each rank's o_proj and down_proj give a partial sum of the layer's
output, which the next RMSNorm needs whole. At batch 1 the sum is one row of 8 KiB, and what
it costs is latency: an NCCL all-reduce kernel, then the norm's launch, 64 times a step. Here
one kernel does it all over symmetric memory (buffers every rank of the group maps,
`torch.distributed._symmetric_memory`), in one shot over NVLink, a program per row (each
program takes rows g, g + G, ... when there are more rows than programs fit on the GPU):

    1. wait for the previous kernel (PDL), then write its partial row into its slot of every
       peer's buffer (posted stores: no round trip, and the peers read locally);
    2. wait until every peer's row has arrived in its own buffer, each value marking its own
       arrival, and empty those slots again (kernels/triton_peers.py);
    3. sum the ranks' rows in rank order (every rank gets the same bits), round to the model's
       dtype as the all-reduce would, then residual <- sum + residual and out <- norm(residual),
       as `kernels.norm.fused_add_rms_norm_reference` of the all-reduced partial does. The
       first norm of the model has no residual to add (its input is the embedding, which each
       rank looks up for the ids it holds): residual <- sum, out <- norm(sum).

Epochs: each row slot counts its calls in `epochs` on its rank, and a call's buffer half is the
low bit of that count plus one (the counters may wrap). Both ranks run the same calls with the
same row counts (the same plans), so their slots' counts agree.

A peer that never arrives stalls the step, as an NCCL collective would; the executor's stall
watch reports it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.all_reduce_norm import reduce_takes
from kernels.peers import PeerBuffers
from kernels.triton_pdl import launches_early, wait_for_previous_kernel
from kernels.triton_peers import int_of_width, receive_row, send_row


@triton.jit
def _sum_rows(mine, own_data, first, cols, mask, hidden, max_rows, RANK, WORLD, BITS):
    """The ranks' rows added in rank order in float32, each peer's once it arrived: every
    rank adds the same values the same way."""
    total = tl.zeros(mine.shape, tl.float32)
    for peer in tl.static_range(WORLD):
        if peer == RANK:
            total += mine.to(tl.float32)
        else:
            theirs = own_data + (first + peer * max_rows).to(tl.int64) * hidden + cols
            total += receive_row(theirs, mask, BITS).to(tl.float32)
    return total


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    partial_ptr,  # [M, H] this rank's partial sums; overwritten with the normed rows
    residual_ptr,  # [M, H], overwritten with the sum + residual (HAS_RESIDUAL; else the sum)
    weight_ptr,  # [H]
    data_addresses_ptr,  # [WORLD] int64
    epochs_ptr,  # [max_rows] int32
    num_rows,
    max_rows,
    hidden,
    stride_partial,
    stride_residual,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BITS: tl.constexpr,  # the integer type of the values' width
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
):
    wait_for_previous_kernel(PDL)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    dtype = partial_ptr.dtype.element_ty
    own_data = tl.load(data_addresses_ptr + RANK).to(tl.pointer_type(dtype))
    own_data = tl.multiple_of(own_data, 16)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Rows g, g + G, ... in order, on every rank alike: G programs all fit on the GPU at once,
    # so no program waits on a peer program that cannot start.
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        row64 = tl.full([], 0, tl.int64) + row  # (a plain int under TRITON_INTERPRET)
        epoch = tl.load(epochs_ptr + row) + 1
        # Where rank r's row lies in any rank's buffer [2, WORLD, max_rows, hidden] this call.
        first = (epoch & 1) * WORLD * max_rows + row
        partial_ptrs = partial_ptr + row64 * stride_partial + cols
        mine = tl.load(partial_ptrs, mask=mask, other=0.0)
        mine = send_row(
            mine, data_addresses_ptr, first, cols, mask, hidden, max_rows, RANK, WORLD, BITS
        )
        total = _sum_rows(mine, own_data, first, cols, mask, hidden, max_rows, RANK, WORLD, BITS)
        res_ptrs = residual_ptr + row64 * stride_residual + cols
        x = total.to(dtype)  # rounded as the all-reduce hands the sum on
        if HAS_RESIDUAL:  # then as the reference adds the residual
            res = tl.load(res_ptrs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(res_ptrs, x, mask=mask)
        x32 = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
        normed = (x32 * rstd).to(dtype).to(tl.float32)
        tl.store(partial_ptrs, normed * weight, mask=mask)
        tl.store(epochs_ptr + row, epoch)


def all_reduce_add_rms_norm(
    partial: torch.Tensor,  # [M, hidden]: this rank's part of the sum; overwritten with the norm
    residual: torch.Tensor | None,  # [M, hidden]: overwritten with the sum + residual
    weight: torch.Tensor,  # [hidden]
    eps: float,
    peers: PeerBuffers,
) -> tuple[torch.Tensor, torch.Tensor]:  # (partial, residual): the inputs, updated
    """`kernels.all_reduce_norm.all_reduce_add_rms_norm_reference`, in place, called by every
    rank of `peers`' group: residual <- (the ranks' partials summed) + residual, partial <-
    rms_norm(residual). No residual: a new tensor holds the sum."""
    hidden = partial.shape[-1]
    has_residual = residual is not None
    if residual is None:
        residual = torch.empty_like(partial)
    if not reduce_takes(peers, partial) or residual.shape != partial.shape:
        raise ValueError(
            f"partial {tuple(partial.shape)} {partial.dtype} and residual "
            f"{tuple(residual.shape)} do not fit the buffers {tuple(peers.data[0].shape)} "
            f"{peers.data[0].dtype}"
        )
    if residual.stride(1) != 1 or residual.dtype != partial.dtype:
        raise ValueError("residual needs contiguous rows of partial's dtype")
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit hidden {hidden}")
    block = triton.next_power_of_2(hidden)
    early = launches_early(partial)
    _all_reduce_add_rms_norm_kernel[(min(partial.shape[0], peers.max_programs),)](
        partial,
        residual,
        weight,
        peers.data_addresses,
        peers.epochs,
        partial.shape[0],
        peers.slots,
        hidden,
        partial.stride(0),
        residual.stride(0),
        eps,
        RANK=peers.rank,
        WORLD=peers.world,
        HAS_RESIDUAL=has_residual,
        BITS=int_of_width(partial.dtype),
        BLOCK_H=block,
        PDL=early,
        num_warps=min(max(block // 512, 1), 16),
        launch_pdl=early,
    )
    return partial, residual
