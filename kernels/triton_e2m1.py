"""MXFP4's e2m1 codes (kernels/mxfp4.py) read in Triton, for the int4 experts' kernels that run
MXFP4 stacks (kernels/triton_moe_int4.py, kernels/triton_moe_int4_gemv.py): a code's value
alone (`e2m1_value`, integer arithmetic, what the interpreter runs), or on the GPU two codes
times their scale in bf16 by inline PTX (`e2m1_pairs`)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.int4_pairs import BF16_E2M1_PAIRS_ASM


@triton.jit
def e2m1_value(q):
    """MXFP4's 4-bit codes (int32, 0..15) as the float32 values they stand for: twice the
    magnitude is m for exponent bits e = 0, else (2 + m) << (e - 1), with m the mantissa bit."""
    e = (q >> 1) & 3
    m = q & 1
    twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
    return tl.where(q >= 8, -twice, twice).to(tl.float32) * 0.5


@triton.jit
def e2m1_pairs(packed, scale):
    """MXFP4 codes times their scales (packed [BN, W] int32, scale [BN, W] bf16: each word's
    group), in bf16 as four [BN, W, 2] tiles: tile p holds nibbles 2p and 2p + 1 of each word
    side by side, as kernels/triton_int4.py's q_minus_z_pairs (kernels/int4_pairs.py's PTX)."""
    scale = scale.to(tl.bfloat16)
    return tl.inline_asm_elementwise(
        BF16_E2M1_PAIRS_ASM,
        "=r,=r,=r,=r,r,r,r",
        [tl.join(packed, packed >> 4), tl.join(scale, scale)],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=2,
    )
