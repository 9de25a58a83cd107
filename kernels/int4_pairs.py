"""int4 nibbles to 16-bit q - z, two at a time, in inline PTX: what the int4 kernels that feed
the tensor cores run on the GPU (kernels/triton_int4.py's dot kernel, the MoE int4 kernels
through it, and kernels/gluon_int4.py). The interpreter runs no assembly: those kernels' CPU
paths get there nibble by nibble."""

from __future__ import annotations

import triton.language as tl

# A 16-bit weight operand from packed nibbles, two elements an instance (pack=2): the inputs
# $4, $5 are the elements' words, the first as is and the second shifted right by 4 (what
# tl.join(packed, packed >> 4) puts side by side), $6 their -(BASE + z) as a 16-bit pair. For
# p = 0..3 a PRMT puts byte p of $4 in the low half and byte p of $5 in the high half (nibbles
# 2p and 2p + 1 of the word when the pair is one word's: each half depends on its own element
# only, so any pairing gives each element nibble 2p of its input), a LOP3 keeps the low nibble
# of each half and ORs in the bits of BASE (1024.0 in fp16, 128.0 in bf16: BASE + q is exact),
# and a packed FMA by 1.0 adds $6: q - z, exact for z in 0..15. $0-$3: the four pairs.
_NIBBLE_PAIRS_ASM = """
{
.reg .b32 one;
mov.b32 one, ONE;
prmt.b32 $0, $4, $5, 0x4400;
prmt.b32 $1, $4, $5, 0x5511;
prmt.b32 $2, $4, $5, 0x6622;
prmt.b32 $3, $4, $5, 0x7733;
lop3.b32 $0, $0, 0x000F000F, BASE, 0xEA;
lop3.b32 $1, $1, 0x000F000F, BASE, 0xEA;
lop3.b32 $2, $2, 0x000F000F, BASE, 0xEA;
lop3.b32 $3, $3, 0x000F000F, BASE, 0xEA;
fma.rn.TYPE $0, $0, one, $6;
fma.rn.TYPE $1, $1, one, $6;
fma.rn.TYPE $2, $2, one, $6;
fma.rn.TYPE $3, $3, one, $6;
}
"""
# (1.0 as a pair, BASE as a pair) of each packed type.
_CONSTANTS = {"bf16x2": ("0x3F803F80", "0x43004300"), "f16x2": ("0x3C003C00", "0x64006400")}


def _typed(template: str, packed_type: str) -> tl.constexpr:
    one, base = _CONSTANTS[packed_type]
    asm = template.replace("ONE", one).replace("BASE", base).replace("TYPE", packed_type)
    return tl.constexpr(asm)


BF16_PAIRS_ASM = _typed(_NIBBLE_PAIRS_ASM, "bf16x2")
FP16_PAIRS_ASM = _typed(_NIBBLE_PAIRS_ASM, "f16x2")

# The same, then each pair times $7 (the elements' scales as a 16-bit pair) by one packed
# multiply: the exact q - z times the scale, rounded once, as the references round
# (q - z) * scale computed in float32 (a product of 5 and 8 or 11 significant bits is exact
# there). `mul.rn` on bf16x2 needs sm_90 (kernels/gluon_int4.py's Hopper kernel).
_SCALED_PAIRS_ASM = _NIBBLE_PAIRS_ASM.replace(
    "}",
    "mul.rn.TYPE $0, $0, $7;\nmul.rn.TYPE $1, $1, $7;\nmul.rn.TYPE $2, $2, $7;\n"
    "mul.rn.TYPE $3, $3, $7;\n}",
)
BF16_SCALED_PAIRS_ASM = _typed(_SCALED_PAIRS_ASM, "bf16x2")
FP16_SCALED_PAIRS_ASM = _typed(_SCALED_PAIRS_ASM, "f16x2")

# MXFP4's e2m1 codes (kernels/mxfp4.py) to bf16 pairs times their group's scale, the inputs as
# above but $6 the elements' scales as a bf16 pair. Each half's nibble s e1 e0 m goes to bits
# 15 (sign), 8-7 (the exponent's low bits) and 6 (the mantissa's top bit): the bf16 of the
# code's value times 2 ** -126 (e = 0: a subnormal, m / 2 of it), so a packed FMA by 2 ** 126
# makes the value and another by the scale the weight, both exact (the scales are powers of
# two; bf16 FMAs keep subnormals). Seven instructions a pair where the nibble-at-a-time path
# runs some fifteen a value.
_E2M1_PAIR = """
prmt.b32 t, $4, $5, SELECT;
and.b32 t, t, 0x000F000F;
shl.b32 s, t, 12;
shl.b32 t, t, 6;
lop3.b32 t, t, s, 0x81C081C0, 0xA8;
fma.rn.bf16x2 t, t, big, nz;
fma.rn.bf16x2 $OUT, t, $6, nz;
"""
BF16_E2M1_PAIRS_ASM = tl.constexpr(
    "{\n.reg .b32 t, s, big, nz;\nmov.b32 big, 0x7E807E80;\nmov.b32 nz, 0x80008000;\n"
    + "".join(
        _E2M1_PAIR.replace("SELECT", select).replace("OUT", str(pair))
        for pair, select in enumerate(("0x4400", "0x5511", "0x6622", "0x7733"))
    )
    + "}\n"
)
