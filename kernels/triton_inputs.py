"""Input token ids gathered from the last sampled ids on the device, in Triton.

Same as `kernels.inputs.gather_sampled_inputs_reference`, in one launch instead of four small
torch ops: it runs in every decode step (inside the CUDA graph), where launches are the cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_pdl import launches_early, wait_for_previous_kernel

_BLOCK = 1024


@triton.jit
def _gather_kernel(
    input_ids_ptr,
    source_rows_ptr,
    sampled_ids_ptr,
    num_tokens,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched early (kernels.triton_pdl)
):
    wait_for_previous_kernel(PDL)
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    rows = tl.load(source_rows_ptr + tokens, mask=tokens < num_tokens, other=-1)  # [BLOCK]
    take = rows >= 0
    ids = tl.load(sampled_ids_ptr + rows, mask=take, other=0)  # [BLOCK]
    tl.store(input_ids_ptr + tokens, ids.to(input_ids_ptr.dtype.element_ty), mask=take)


def gather_sampled_inputs(
    input_ids: torch.Tensor,  # [num_tokens] int32, updated in place
    source_rows: torch.Tensor,  # [num_tokens] int32: row of sampled_ids to take, or -1
    sampled_ids: torch.Tensor,  # [max_reqs] int64: the last step's sampled token ids
) -> None:
    if input_ids.shape != source_rows.shape or input_ids.dim() != 1:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and source_rows {tuple(source_rows.shape)} "
            "must be the same [num_tokens]"
        )
    if not (
        input_ids.is_contiguous() and source_rows.is_contiguous() and sampled_ids.is_contiguous()
    ):
        raise ValueError("input_ids, source_rows and sampled_ids must be contiguous")
    num_tokens = input_ids.shape[0]
    if num_tokens == 0:
        return
    grid = (triton.cdiv(num_tokens, _BLOCK),)
    early = launches_early(input_ids)
    _gather_kernel[grid](
        input_ids, source_rows, sampled_ids, num_tokens, BLOCK=_BLOCK, PDL=early, launch_pdl=early
    )
