"""The embedding lookup of a rank holding some of the vocabulary (`kernels.embedding`), in Triton.

One kernel instead of the half dozen elementwise ops the reference is made of (offset, range
test, clamp, gather, mask): at batch 1 with tensor parallelism those launches cost more than
the lookup. A program copies one token's row, a column block at a time, or writes zeros where
another rank holds the id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_pdl import launches_early, wait_for_previous_kernel

_BLOCK_ELEMENTS = 1024  # columns a program copies


# NOTE: the token count follows the step's; not specialised, so no step size compiles anew.
@triton.jit(do_not_specialize=["num_tokens"])
def _embedding_rows_kernel(
    ids_ptr,  # [T]
    weight_ptr,  # [rows, hidden]
    out_ptr,  # [T, hidden]
    num_tokens,
    first_id,
    num_rows,
    hidden,
    stride_ids,
    stride_weight,
    stride_out,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    # The id's row, as a vector over the block (a scalar mask is not one Triton takes).
    local = tl.full([BLOCK], 0, tl.int64) + tl.load(ids_ptr + token * stride_ids) - first_id
    held = (local >= 0) & (local < num_rows)
    row = tl.where(held, local, 0)
    values = tl.load(weight_ptr + row * stride_weight + cols, mask=mask & held, other=0.0)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, values, mask=mask)


def embedding_rows(ids: torch.Tensor, weight: torch.Tensor, first_id: int) -> torch.Tensor:
    """`kernels.embedding.embedding_rows_reference`."""
    if ids.dim() != 1 or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(
            f"ids [T] and weight [rows, hidden] with contiguous rows, got "
            f"{tuple(ids.shape)} and {tuple(weight.shape)}"
        )
    num_tokens, (num_rows, hidden) = ids.shape[0], weight.shape
    out = torch.empty(num_tokens, hidden, dtype=weight.dtype, device=weight.device)
    if num_tokens == 0:
        return out
    block = min(_BLOCK_ELEMENTS, triton.next_power_of_2(hidden))
    early = launches_early(weight)
    _embedding_rows_kernel[(num_tokens, triton.cdiv(hidden, block))](
        ids,
        weight,
        out,
        num_tokens,
        first_id,
        num_rows,
        hidden,
        ids.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK=block,
        PDL=early,
        launch_pdl=early,
    )
    return out
