"""gpt-oss's MXFP4 checkpoints: each layer's experts as `X_blocks` and `X_scales`
(kernels/mxfp4.py), the rest float. The experts are dequantized to float as the checkpoint
streams, into the tensor `X` that its bf16 checkpoints hold ([E, in, out], gate and up
columns interleaved), which the model's fused expert loader reads (layers/moe.py). So the
experts take bf16's memory (or FP8's, with --quantization fp8): MXFP4 experts are not kept
as such yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kernels.mxfp4 import dequantize_mxfp4
from services.executor.parallel.shards import Loaded, read

PARTS = ("_blocks", "_scales")


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
