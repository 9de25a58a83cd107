"""int4 weight-only (W4A16) linear layers: the packed layout and the torch references.

Every int4 checkpoint format (AWQ, GPTQ, compressed-tensors pack-quantized) is translated at
load into one layout, which the kernels read:

    qweight [N, K/8] int32   eight unsigned 4-bit values q per word, along K, in chunks of
                             CHUNK = 32 columns (4 words): word c of a chunk holds, at bits
                             4*i for nibble i = 2p + h, the chunk's column 8p + 2c + h
    scales  [N, G]           float, one per output channel and group of input columns
    zeros   [N, G] uint8     the zero point z of each group, 0..15; None means 8 (symmetric)
    g_idx   [K] int32        the group of each input column (GPTQ's act-order); None means
                             column k is in group k // group_size

and the weight is w[n, k] = (q[n, k] - z[n, g]) * scales[n, g] with g the group of k. Why the
chunks: nibbles 2p, 2p+1 of the 4 words of a chunk then hold its 8 consecutive columns
8p .. 8p+7, so the tl.dot kernel's x operand comes in runs of 8 columns, and the CUDA-core
kernel reads the 4 consecutive 16-bit pairs 4p .. 4p+3 with one vector load
(kernels/triton_int4.py). K and group sizes are multiples of CHUNK, so a word's 8 columns
share a group. `pack_int4` / `unpack_int4` are the plain nibble packing (value c at bits
4*(c % 8) of word c // 8) that checkpoints use; `transpose_chunks` turns it into the kernel
layout and back, and `pack_weight` / `unpack_weight` go from values to the kernel layout. The
reference dequantizes to the activation's dtype, then sums in float32 (the Triton kernels'
fast paths apply the scale after the sum).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

PACK = 8  # 4-bit values per int32 word
CHUNK = 32  # columns of the kernels' interleave (module docstring)
SYMMETRIC_ZERO = 8
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # [8]


# How a Triton int4 launch tiles its work (kernels/triton_int4.py picks one per shape).
KINDS = ("rows", "dot", "dequant_dot")


class Int4Stack(NamedTuple):
    """A mixture of experts' int4 projection (W4A16), stacked by expert: each expert's
    weight in the layout above. With `e2m1`, MXFP4 experts (kernels/mxfp4.py) in the same
    layout: each code stands for its e2m1 value, times its group's power-of-two scale."""

    qweight: torch.Tensor  # [E, N, K/8] int32
    scales: torch.Tensor  # [E, N, G]
    zeros: torch.Tensor | None  # [E, N, G] uint8; None: 8 (symmetric)
    group_size: int  # input columns a scale spans (K: one a row)
    e2m1: bool = False  # MXFP4's codes: no zero points, groups of 32


@dataclasses.dataclass(frozen=True)
class Int4Tiles:
    kind: str  # one of KINDS (kernels/triton_int4.py's docstring)
    block_m: int  # rows of x per program: 1 for "rows"
    block_n: int  # weight rows per program
    block_k: int  # K a step: whole chunks; DOT_STEP steps (dot); >= 128 (dequant_dot)
    num_warps: int
    num_stages: int
    split_k: int = 1  # "dot": programs along K per output tile

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Int4Tiles.kind must be one of {KINDS}, got {self.kind!r}")
        if self.split_k < 1 or (self.split_k > 1 and self.kind != "dot"):
            raise ValueError("Int4Tiles.split_k: >= 1, and above 1 for the dot kernel only")


def pack_int4(values: torch.Tensor) -> torch.Tensor:  # [R, C] in 0..15 -> [R, C/8] int32
    """Pack along the last dimension: value c at bits 4*(c % 8) of word c // 8."""
    if values.shape[-1] % PACK:
        raise ValueError(f"int4 packing needs a multiple of {PACK} columns, got {values.shape}")
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, PACK)  # [R, C/8, 8]
    words = (v << _SHIFTS.to(v.device, torch.int64)).sum(dim=-1)  # [R, C/8], 0 .. 2**32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:  # [R, W] int32 -> [R, 8 W] uint8
    """The inverse of `pack_int4`."""
    nibbles = (packed[..., None] >> _SHIFTS.to(packed.device)) & 0xF  # [R, W, 8]
    return nibbles.reshape(*packed.shape[:-1], -1).to(torch.uint8)


def transpose_chunks(packed: torch.Tensor) -> torch.Tensor:  # [N, K/8] int32, either way
    """Plain packing <-> the kernel layout. Byte b of a word holds nibbles 2b, 2b + 1; in the
    plain packing byte b of word p holds columns 8p + 2b + {0, 1}, in the kernel layout byte p
    of word c holds 8p + 2c + {0, 1}: a 4 x 4 transpose of each chunk's bytes (its own
    inverse)."""
    n, words = packed.shape
    if words % (CHUNK // PACK):
        raise ValueError(f"int4 layers need K divisible by {CHUNK}, got {words * PACK}")
    chunks = packed.contiguous().view(torch.uint8).reshape(n, -1, 4, 4)  # [N, K/32, word, byte]
    return chunks.transpose(-1, -2).contiguous().view(torch.int32).reshape(n, words)


def pack_weight(values: torch.Tensor) -> torch.Tensor:  # [N, K] in 0..15 -> [N, K/8] int32
    """The kernel layout of a weight's 4-bit values."""
    return transpose_chunks(pack_int4(values))


def unpack_weight(qweight: torch.Tensor) -> torch.Tensor:  # [N, K/8] int32 -> [N, K] uint8
    """The inverse of `pack_weight`."""
    return unpack_int4(transpose_chunks(qweight))


def group_index(
    k: int, group_size: int, g_idx: torch.Tensor | None, device: torch.device
) -> torch.Tensor:  # [K] int64
    """The group of each input column."""
    if g_idx is not None:
        return g_idx.to(device, torch.int64)
    return torch.arange(k, device=device) // group_size


def dequantize_int4_reference(
    qweight: torch.Tensor,  # [N, K/8] int32
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None,  # [N, G] uint8; None: 8
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
) -> torch.Tensor:  # [N, K] float32
    q = unpack_weight(qweight).float()  # [N, K]
    groups = group_index(q.shape[1], group_size, g_idx, q.device)  # [K]
    zero = SYMMETRIC_ZERO if zeros is None else zeros.float()[:, groups]
    return (q - zero) * scales.float()[:, groups]


def dequantize_int4_stack(stack: Int4Stack, dtype: torch.dtype) -> torch.Tensor:  # [E, N, K]
    """Every expert's weight, dequantized and rounded to `dtype` (as int4_linear_reference);
    MXFP4 stacks: kernels.mxfp4.dequantize_4bit_stack."""
    if stack.e2m1:
        raise ValueError("an MXFP4 stack: kernels.mxfp4.dequantize_4bit_stack reads it")
    return torch.stack([
        dequantize_int4_reference(
            stack.qweight[e], stack.scales[e],
            None if stack.zeros is None else stack.zeros[e], stack.group_size,
        ).to(dtype)
        for e in range(stack.qweight.shape[0])
    ])  # fmt: skip


def int4_linear_reference(
    x: torch.Tensor,  # [M, K], bf16/fp16/fp32
    qweight: torch.Tensor,  # [N, K/8] int32
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None,  # [N, G] uint8; None: 8
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x.dtype
    """x times the weight dequantized to x's dtype, summed in float32."""
    weight = dequantize_int4_reference(qweight, scales, zeros, group_size, g_idx).to(x.dtype)
    out = x.float() @ weight.float().t()  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def quantize_int4_reference(
    weight: torch.Tensor,  # [N, K] float
    group_size: int,
    symmetric: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # qweight, scales, zeros
    """Round-to-nearest int4 per group, for tests and benchmarks. Symmetric
    groups span [-8, 7] * scale around 0; asymmetric ones [min, max] in 15 steps."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    w = weight.float().reshape(n, k // group_size, group_size)  # [N, G, size]
    if symmetric:
        scales = (w.abs().amax(dim=-1) / 7.5).clamp(min=1e-8)  # [N, G]
        zero = torch.full_like(scales, SYMMETRIC_ZERO)
    else:
        low, high = w.amin(dim=-1).clamp(max=0), w.amax(dim=-1).clamp(min=0)
        scales = ((high - low) / 15).clamp(min=1e-8)
        zero = (-low / scales).round().clamp(0, 15)
    q = (w / scales[..., None] + zero[..., None]).round().clamp(0, 15).reshape(n, k)
    zeros = None if symmetric else zero.to(torch.uint8)
    return pack_weight(q), scales.to(weight.dtype), zeros
