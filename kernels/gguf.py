"""GGUF quantized weights kept as llama.cpp writes them: the block layouts and the torch
references.

A GGUF weight [N, K] of a quantized type is N rows of K / block_elems blocks, each a fixed
number of bytes; kvflow keeps those bytes unchanged in memory, `raw [N, row_bytes] uint8`, and
the kernels dequantize them where they are read. The types (llama.cpp's ggml-quants.c):

    Q8_0  32 values, 34 bytes:  d f16, q int8[32]                    w = d q
    Q4_0  32 values, 18 bytes:  d f16, nibbles[16]                   w = d (q - 8)
    Q4_1  32 values, 20 bytes:  d f16, m f16, nibbles[16]            w = d q + m
    Q5_0  32 values, 22 bytes:  d f16, high bits u32, nibbles[16]    w = d (q - 16)
    Q5_1  32 values, 24 bytes:  d f16, m f16, high bits, nibbles     w = d q + m
    Q4_K  256 values, 144 bytes: d, dmin f16, 6-bit scales/mins of 8 sub-blocks of 32,
                                 nibbles[128]                         w = d sc q - dmin m
    Q5_K  256 values, 176 bytes: as Q4_K, plus high bits[32]
    Q6_K  256 values, 210 bytes: low nibbles[128], 2-bit highs[64], int8 scales of 16
                                 sub-blocks of 16, d f16              w = d sc (q - 32)

Within a 32-value block (and each 64-value chunk of a K-quant), nibble byte j holds value j in
its low half and value j + 16 (j + 32) in its high half.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GgufType:
    name: str
    type_id: int  # ggml_type, as the GGUF file stores it
    block_elems: int
    block_bytes: int


GGUF_TYPES = {
    t.name: t
    for t in (
        GgufType("Q4_0", 2, 32, 18),
        GgufType("Q4_1", 3, 32, 20),
        GgufType("Q5_0", 6, 32, 22),
        GgufType("Q5_1", 7, 32, 24),
        GgufType("Q8_0", 8, 32, 34),
        GgufType("Q4_K", 12, 256, 144),
        GgufType("Q5_K", 13, 256, 176),
        GgufType("Q6_K", 14, 256, 210),
    )
}


def row_bytes(qtype: str, k: int) -> int:
    t = GGUF_TYPES[qtype]
    if k % t.block_elems:
        raise ValueError(f"{qtype} rows hold whole blocks of {t.block_elems}; K = {k}")
    return k // t.block_elems * t.block_bytes


def dequantize_gguf_reference(raw: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """raw [N, row_bytes] uint8 -> the weight [N, K] float32."""
    t = GGUF_TYPES[qtype]
    if raw.dtype != torch.uint8 or raw.shape[-1] != row_bytes(qtype, k):
        raise ValueError(f"{qtype} weight of K = {k} needs [N, {row_bytes(qtype, k)}] uint8")
    blocks = raw.reshape(raw.shape[0], k // t.block_elems, t.block_bytes)  # [N, B, bytes]
    return _DEQUANTIZE[qtype](blocks).reshape(raw.shape[0], k)


def gguf_linear_reference(
    x: torch.Tensor,  # [M, K]
    raw: torch.Tensor,  # [N, row_bytes] uint8
    qtype: str,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x.dtype
    """Dequantize to x's dtype, then multiply with a float32 sum."""
    weight = dequantize_gguf_reference(raw, qtype, x.shape[1]).to(x.dtype)
    out = x.float() @ weight.float().t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:  # [N, B, 1] float32
    return blocks[..., at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:  # [..., L] -> [..., 2L]: low halves, then high
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:  # [..., count/8] -> [..., count]
    bits = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh[..., :, None] >> bits) & 1).reshape(*qh.shape[:-1], count)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[..., 2:].view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[..., 2:]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[..., 4:]).float() + _f16(b, 2)


def _q5(b: torch.Tensor, low_at: int) -> torch.Tensor:  # the 5-bit values of Q5_0 and Q5_1
    high = _high_bits(b[..., low_at - 4 : low_at], 32)
    return (_nibbles(b[..., low_at:]) | (high << 4)).float()


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_q5(b, 6) - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _q5(b, 8) + _f16(b, 2)


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    s = s.long()
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], -1).float(), torch.cat([low_m, high_m], -1).float()


def _k_quant(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # q [N, B, 256]
    sc, m = _k_scales_mins(b[..., 4:16])  # [N, B, 8] each
    q = q.float().reshape(*q.shape[:-1], 8, 32)
    w = (_f16(b, 0)[..., None] * sc[..., None]) * q - (_f16(b, 2)[..., None] * m[..., None])
    return w.flatten(-2)


def _chunked_nibbles(qs: torch.Tensor) -> torch.Tensor:  # [..., 128] -> [..., 256]
    """Four chunks of 32 bytes, each giving 64 values (low halves, then high halves)."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return _nibbles(chunks).flatten(-2)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_quant(b, _chunked_nibbles(b[..., 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # Bit s of high byte j is the fifth bit of value j of sub-block s.
    high = (b[..., 16:48, None] >> torch.arange(8, device=b.device, dtype=torch.uint8)) & 1
    high = high.transpose(-1, -2).flatten(-2)  # [N, B, 256]: sub-block s, then j
    return _k_quant(b, _chunked_nibbles(b[..., 48:176]) | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32)  # [N, B, half, low/high 32, 32]
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)  # [N, B, half, 1, 32]
    low = torch.cat([ql & 0xF, ql >> 4], dim=-2)  # [N, B, half, 4, 32]: quarters r = 0..3
    shifts = torch.arange(0, 8, 2, device=b.device, dtype=torch.uint8)[:, None]  # [4, 1]
    q = (low | (((qh >> shifts) & 3) << 4)).float() - 32  # [N, B, 2, 4, 32]
    scales = b[..., 192:208].view(torch.int8).float().reshape(*b.shape[:-1], 2, 4, 2, 1)
    d = _f16(b, 208).reshape(*b.shape[:-1], 1, 1, 1, 1)
    w = d * scales * q.reshape(*q.shape[:-1], 2, 16)
    return w.reshape(*b.shape[:-1], 256)


_DEQUANTIZE = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
