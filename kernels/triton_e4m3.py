"""FP8 e4m3 inside Triton kernels, identically compiled and interpreted: rounding to it, and
the scale a row or group quantizes by (`kernels.fp8`'s references define both)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.fp8 import FP8_MAX, MIN_SCALE

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def scale_for(amax):
    """The scale of values whose absolute maximum is amax: amax / 448, never below MIN_SCALE
    (a row of zeros still gets a usable one)."""
    return tl.maximum(amax / _FP8_MAX, _MIN_SCALE)


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
