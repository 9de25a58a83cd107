"""Rounding to FP8 e4m3 inside Triton kernels, identically compiled and interpreted."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(v):
    """v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still in float32.

    Why by hand: the conversion that follows is then exact, whatever rounding the backend's
    float32 -> e4m3 conversion does (the interpreter's drops a carry into the exponent: 125.6
    became 64). Normal values keep 3 of float32's 23 mantissa bits; below e4m3's smallest
    normal (2**-6) the grid is a fixed step of 2**-9.
    """
    bits = v.to(tl.int32, bitcast=True)
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # ~0xFFFFF as int32
    normal = kept.to(tl.float32, bitcast=True)
    magic = 1.5 * 2.0**14  # its float32 ulp is 2**-9: (v + magic) - magic rounds to that step
    subnormal = (v + magic) - magic
    return tl.where(tl.abs(v) >= 2.0**-6, normal, subnormal)


@triton.jit
def to_e4m3(v):
    """float32 v saturated to e4m3's range and rounded to it (ties to even), as float32: what
    torch's `.clamp(-448, 448).to(float8_e4m3fn)` stores."""
    return round_to_e4m3(tl.clamp(v, -448.0, 448.0))
