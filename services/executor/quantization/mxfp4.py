"""gpt-oss's MXFP4 checkpoints: each layer's experts as `X_blocks` and `X_scales`
(kernels/mxfp4.py), the rest float.

By default the experts stay MXFP4 (`Mxfp4Experts`): the codes in the int4 experts' packed
layout, the scales as bfloat16 powers of two, run by the int4 experts' kernels reading each
code as its e2m1 value (kernels/triton_moe_int4.py): 4.5 bits a weight against bf16's 16.
With --quantization fp8 they are dequantized as the checkpoint streams (`dequantized_mxfp4`)
into the tensors its bf16 checkpoints hold, which the float or FP8 experts then load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels import ops
from kernels.int4 import PACK, Int4Stack
from kernels.mxfp4 import GROUP, dequantize_mxfp4, packed_codes, scale_values
from services.executor.layers.linear import Unquantized
from services.executor.layers.weight_loader import copy_weight, unpacked
from services.executor.parallel.shards import CheckpointTensor, Loaded, read

if TYPE_CHECKING:
    from services.executor.layers.moe import SparseMoE

PARTS = ("_blocks", "_scales")
DUMMY_SCALES = (119, 121)  # e8m0 from, to (excluded): 2 ** -8 or 2 ** -7, as the float dummy


def dequantized_mxfp4(tensors: Iterable[tuple[str, Loaded]]) -> Iterator[tuple[str, Loaded]]:
    """The checkpoint's (name, tensor) stream with each blocks-and-scales pair (in any order,
    any file) replaced by the float tensor it stands for, transposed to [E, in, out]."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        part = next((p for p in PARTS if name.endswith(p)), None)
        if part is None:
            yield name, tensor
            continue
        base = name.removesuffix(part)
        pair = pending.setdefault(base, {})
        pair[part] = read(tensor)
        if len(pair) == len(PARTS):
            del pending[base]
            values = dequantize_mxfp4(pair["_blocks"], pair["_scales"])  # [E, out, in]
            yield base, values.transpose(1, 2).to(torch.bfloat16).contiguous()
    if pending:
        raise ValueError(f"MXFP4 tensors without their other half: {sorted(pending)[:3]}")


class Mxfp4Checkpoint(Unquantized):
    """The linear layers of an MXFP4 checkpoint: float, as gpt-oss's attention and router are
    stored; its experts are `Mxfp4Experts` (quantization/methods.py)."""

    name = "mxfp4"


class Mxfp4Experts:
    """gpt-oss's experts as its checkpoints hold them, MXFP4, in `Int4Stack`s with `e2m1`."""

    name = "mxfp4"

    def create_weights(self, moe: SparseMoE, hidden: int, columns: int) -> None:
        if not moe.moe.fused_checkpoint:
            raise ValueError("MXFP4 experts are gpt-oss's; this model's experts are not")
        if columns % GROUP:
            raise ValueError(
                f"MXFP4 experts cut over tensor-parallel ranks need each rank's {columns} "
                f"columns in whole groups of {GROUP}: use fewer ranks, "
                "--enable-expert-parallel, or --quantization fp8"
            )
        for name, rows, k in (("experts_gate_up", 2 * columns, hidden),
                              ("experts_down", hidden, columns)):  # fmt: skip
            if k % GROUP:
                raise ValueError(f"MXFP4 experts need input columns in groups of {GROUP}: {k}")
            moe.stack(name, rows, k // PACK, torch.int32, fused_loader=_load_fused_mxfp4)
            moe.stack(f"{name}_scale", rows, k // GROUP, torch.bfloat16,
                      fused_loader=_load_fused_mxfp4)  # fmt: skip

    def stacks(self, moe: SparseMoE) -> tuple[Int4Stack, Int4Stack]:
        """(gate_up, down) as the kernels read them."""
        return (
            Int4Stack(moe.experts_gate_up, moe.experts_gate_up_scale, None, GROUP, e2m1=True),
            Int4Stack(moe.experts_down, moe.experts_down_scale, None, GROUP, e2m1=True),
        )

    def init_dummy(self, moe: SparseMoE, generator: torch.Generator) -> None:
        """Random codes, scales of 2 ** -8 or 2 ** -7: weights of the float dummy's spread."""
        for stack in self.stacks(moe):
            device = stack.qweight.device
            bits = torch.randint(-(2**31), 2**31, stack.qweight.shape, generator=generator,
                                 device=device)  # fmt: skip
            stack.qweight.data.copy_(bits)
            exponents = torch.randint(*DUMMY_SCALES, stack.scales.shape, generator=generator,
                                      device=device)  # fmt: skip
            stack.scales.data.copy_(scale_values(exponents))

    def prepare(self, moe: SparseMoE) -> None:
        pass

    def apply(
        self, moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        return ops.moe_experts_int4(
            x, *self.stacks(moe), weights, ids, moe.biases, moe.swiglu, moe.moe.num_experts
        )


def _load_fused_mxfp4(
    param: nn.Parameter,
    tensor: CheckpointTensor,
    shard: int | None,
    name: str,
    *,
    first: int,
    part: int,
    parts: int,
    kind: str,
) -> None:
    """One of a layer's MXFP4 expert tensors into the rank's experts first, first + 1, ...:
    gate_up_proj_blocks [E, 2 I, H / 32, 16] (gate and up rows interleaved) and its scales
    [E, 2 I, H / 32] as gate rows, then up rows, of each its part `part` of `parts` of the I
    rows; down_proj_blocks [E, H, I / 32, 16] and its scales by part of the I columns' groups
    (whole groups: `Mxfp4Experts.create_weights` refused other splits). Blocks become the
    kernels' packed words, scales bfloat16 powers of two."""
    experts = param.shape[0]
    whole = read(unpacked(tensor, name).narrow(0, first, experts))  # the rank's experts
    if kind.startswith("experts_gate_up"):
        rows = whole.shape[1] // 2 // parts
        gate, up = (whole[:, h::2][:, part * rows : (part + 1) * rows] for h in (0, 1))
        whole = torch.cat([gate, up], dim=1)
    else:  # experts_down: its K (= I) groups
        groups = whole.shape[2] // parts
        whole = whole[:, :, part * groups : (part + 1) * groups]
    value = scale_values(whole) if kind.endswith("_scale") else packed_codes(whole)
    copy_weight(param.data, value, name)
