"""MXFP4 (OCP microscaling FP4), as gpt-oss's checkpoints store its experts: each group of 32
consecutive values along a row shares one power-of-two scale.

    blocks [..., rows, G, 16] uint8   two e2m1 values a byte, the even-indexed one in the low
                                      nibble: value 2j of a group in byte j's bits 0-3
    scales [..., rows, G] uint8       e8m0: the group's scale is 2 ** (scale - 127)

An e2m1 nibble is a sign bit and three bits that index 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""

from __future__ import annotations

import torch

GROUP = 32  # values a scale covers
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
               -6.0)  # fmt: skip


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [..., rows, G, 16] uint8
    scales: torch.Tensor,  # [..., rows, G] uint8
) -> torch.Tensor:  # [..., rows, G * 32] float32
    """The values the blocks and scales stand for."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: blocks must be "
            f"[..., G, {GROUP // 2}] with scales [..., G]"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.int64)
    values = torch.stack((table[codes & 0xF], table[codes >> 4]), dim=-1)  # [..., G, 16, 2]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values.flatten(-2), exponents[..., None].float())  # [..., G, 32]
    return values.flatten(-2)
