"""MXFP4 (OCP microscaling FP4), as gpt-oss's checkpoints store its experts: each group of 32
consecutive values along a row shares one power-of-two scale.

    blocks [..., rows, G, 16] uint8   two e2m1 values a byte, the even-indexed one in the low
                                      nibble: value 2j of a group in byte j's bits 0-3
    scales [..., rows, G] uint8       e8m0: the group's scale is 2 ** (scale - 127)

An e2m1 nibble is a sign bit and three bits that index 0, 0.5, 1, 1.5, 2, 3, 4, 6.

The kernels keep MXFP4 experts as MXFP4: `as_int4_layout` moves the nibbles into
kernels/int4.py's packed layout (the same 4-bit codes, in the chunks the int4 kernels read)
and the e8m0 scales into bfloat16 powers of two, so an `Int4Stack` with `e2m1` set holds them
and the int4 experts' kernels run them, each code read as its e2m1 value rather than q - z.
"""

from __future__ import annotations

import torch

from kernels.int4 import Int4Stack, dequantize_int4_stack, transpose_chunks, unpack_weight

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


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:  # 0..15 -> float32
    """The value each e2m1 code stands for."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.to(torch.int64)]


def scale_values(scales: torch.Tensor) -> torch.Tensor:  # e8m0 uint8 -> bfloat16
    """2 ** (scale - 127): exact in bfloat16, which has float32's exponents; 255 is e8m0's
    NaN."""
    one = torch.ones(scales.shape, dtype=torch.float32, device=scales.device)
    values = torch.ldexp(one, scales.to(torch.int32) - 127)
    return torch.where(scales == 255, torch.nan, values).to(torch.bfloat16)


def as_int4_layout(
    blocks: torch.Tensor,  # [..., rows, G, 16] uint8
    scales: torch.Tensor,  # [..., rows, G] uint8
) -> tuple[torch.Tensor, torch.Tensor]:  # [..., rows, G * 4] int32, [..., rows, G] bfloat16
    """The codes in kernels/int4.py's kernel layout and the scales as bfloat16. Byte j of a
    group holds its values 2j (low nibble) and 2j + 1, so four bytes read as a little-endian
    word hold 8 consecutive values at bits 4 * (c % 8): `pack_int4`'s plain packing."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: blocks must be "
            f"[..., G, {GROUP // 2}] with scales [..., G]"
        )
    return packed_codes(blocks), scale_values(scales)


def packed_codes(blocks: torch.Tensor) -> torch.Tensor:  # [..., G, 16] uint8 -> [..., G * 4]
    """The blocks' codes in kernels/int4.py's kernel layout (`as_int4_layout`)."""
    if blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} must be [..., G, {GROUP // 2}]")
    lead, words = blocks.shape[:-2], blocks.shape[-2] * GROUP // 8
    plain = blocks.contiguous().view(torch.int32).reshape(-1, words)
    return transpose_chunks(plain).reshape(*lead, words)


def dequantize_4bit_stack(stack: Int4Stack, dtype: torch.dtype) -> torch.Tensor:  # [E, N, K]
    """Every expert's weight of an int4 or MXFP4 (`e2m1`) stack, dequantized and rounded to
    `dtype`: an MXFP4 code's e2m1 value times its group's scale."""
    if not stack.e2m1:
        return dequantize_int4_stack(stack, dtype)
    return torch.stack([  # expert by expert: a stack's float32 at once would be gigabytes
        (e2m1_values(unpack_weight(codes)) * scales.float().repeat_interleave(GROUP, -1)).to(dtype)
        for codes, scales in zip(stack.qweight, stack.scales, strict=True)
    ])  # fmt: skip
