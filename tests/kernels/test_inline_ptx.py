"""The kernels' inline PTX, executed here instruction by instruction as the PTX ISA defines
them: the int4 kernels' nibble pairs (kernels/int4_pairs.py: q - z, and q - z times the scale
for the Gluon kernel) and the decode attention's e4m3 words (`_E4M3_WORD_ASM`). CI has no GPU,
and the interpreter runs the kernels' plain-Triton paths instead, so without this only a GPU
run would notice a wrong selector, mask, constant or output order."""

from __future__ import annotations

import random
import re

import pytest
import torch

pytest.importorskip("triton")

from kernels import int4_pairs, triton_decode_attention

MASK32 = 0xFFFFFFFF
ASM = {torch.bfloat16: int4_pairs.BF16_PAIRS_ASM, torch.float16: int4_pairs.FP16_PAIRS_ASM}
SCALED_ASM = {
    torch.bfloat16: int4_pairs.BF16_SCALED_PAIRS_ASM,
    torch.float16: int4_pairs.FP16_SCALED_PAIRS_ASM,
}
BASE = {torch.bfloat16: 128.0, torch.float16: 1024.0}


def prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32 in its default mode: byte i of the result is byte selector[i] of {b, a}
    (bytes 0-3 from a, 4-7 from b), sign-replicated where the selector's bit 3 is set."""
    source = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        pick = (selector >> 4 * i) & 0xF
        byte = source[pick & 7]
        if pick & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * i
    return out


def lop3(a: int, b: int, c: int, lut: int) -> int:
    """lop3.b32: each result bit is bit (a << 2 | b << 1 | c) of the lookup table."""
    bits = (((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1), i) for i in range(32))
    return sum((lut >> index & 1) << i for index, i in bits)


def halves(bits: int, dtype: torch.dtype) -> list[float]:
    pair = torch.tensor([bits & MASK32], dtype=torch.int64).to(torch.int32).view(dtype)
    return pair.tolist()


def packed(values: list[float], dtype: torch.dtype) -> int:
    return torch.tensor(values, dtype=dtype).view(torch.int32).item() & MASK32


def fma_x2(a: int, b: int, c: int, dtype: torch.dtype) -> int:
    """fma.rn on two 16-bit halves: a * b + c exactly, rounded once (float64 holds it)."""
    exact = [x * y + z for x, y, z in zip(*(halves(v, dtype) for v in (a, b, c)), strict=True)]
    return packed(exact, dtype)


def mul_x2(a: int, b: int, dtype: torch.dtype) -> int:
    """mul.rn on two 16-bit halves: a * b exactly, rounded once."""
    exact = [x * y for x, y in zip(halves(a, dtype), halves(b, dtype), strict=True)]
    return packed(exact, dtype)


def e4m3x2_to_f16x2(pair: int) -> int:
    """cvt.rn.f16x2.e4m3x2: the low byte's value in the low half, the high byte's above."""
    values = torch.tensor([pair & 0xFF, pair >> 8 & 0xFF], dtype=torch.uint8)
    return packed(values.view(torch.float8_e4m3fn).to(torch.float16).tolist(), torch.float16)


def run_asm(text: str, registers: dict[str, int], dtype: torch.dtype) -> dict[str, int]:
    """Execute the asm's instructions on registers named as in the text (32-bit, or 16-bit
    where a `mov.b32 {lo, hi}` splits or fills them)."""

    def value(operand: str) -> int:  # an immediate or a register
        return int(operand, 16) if operand.startswith("0x") else registers[operand]

    for line in text.splitlines():
        split = re.fullmatch(r"\s*mov\.b32\s+\{(\S+),\s*(\S+)\},\s*(\S+);", line)
        if split is not None:  # a 32-bit value into two 16-bit registers, low half first
            low, high, source = split.groups()
            registers[low], registers[high] = value(source) & 0xFFFF, value(source) >> 16 & 0xFFFF
            continue
        match = re.fullmatch(r"\s*([a-z][\w.]*)\s+(.*);", line)
        if match is None:
            continue  # braces, register declarations (.reg)
        op, operands = match.group(1), [o.strip() for o in match.group(2).split(",")]
        args = [value(o) for o in operands[1:]]
        if op == "mov.b32":
            result = args[0]
        elif op == "prmt.b32":
            result = prmt(*args)
        elif op == "lop3.b32":
            result = lop3(*args)
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            result = fma_x2(*args, dtype)
        elif op in ("mul.rn.bf16x2", "mul.rn.f16x2"):
            result = mul_x2(*args, dtype)
        elif op == "cvt.rn.f16x2.e4m3x2":
            result = e4m3x2_to_f16x2(args[0])
        else:
            raise AssertionError(f"an instruction this test does not know: {line.strip()}")
        registers[operands[0]] = result & MASK32
    return registers


def pair_registers(word: int, zero: int, dtype: torch.dtype) -> dict[str, int]:
    """The pairs' inputs as the kernels pass them: the word, the word >> 4 (an arithmetic
    shift on int32), -(BASE + z) as a 16-bit pair."""
    signed = word - (1 << 32) if word >> 31 else word
    offset = -(BASE[dtype] + zero)
    return {"$4": word, "$5": (signed >> 4) & MASK32, "$6": packed([offset, offset], dtype)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_nibble_pairs_asm_makes_q_minus_z_exactly(dtype: torch.dtype) -> None:
    generator = random.Random(0)
    for _ in range(200):
        word = generator.getrandbits(32)
        zero = generator.randrange(16)
        out = run_asm(ASM[dtype].value, pair_registers(word, zero, dtype), dtype)
        nibbles = [(word >> 4 * i) & 0xF for i in range(8)]
        for p in range(4):
            assert halves(out[f"${p}"], dtype) == [nibbles[2 * p] - zero, nibbles[2 * p + 1] - zero]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_scaled_pairs_asm_rounds_as_the_reference(dtype: torch.dtype) -> None:
    # (q - z) * s once rounded, as kernels.int4's reference: (q - z) * s in float32, then x's
    # dtype (the product of a 5-bit integer and a 16-bit float is exact in float32).
    generator = random.Random(2)
    for _ in range(200):
        word = generator.getrandbits(32)
        zero = generator.randrange(16)
        scale = torch.tensor(generator.uniform(-0.05, 0.05)).to(dtype)
        registers = pair_registers(word, zero, dtype)
        registers["$7"] = packed([scale.item(), scale.item()], dtype)
        out = run_asm(SCALED_ASM[dtype].value, registers, dtype)
        q = torch.tensor([(word >> 4 * i) & 0xF for i in range(8)], dtype=torch.float32)
        expected = ((q - zero) * scale.float()).to(dtype).tolist()
        for p in range(4):
            assert halves(out[f"${p}"], dtype) == expected[2 * p : 2 * p + 2]


def test_each_half_depends_on_its_own_element_only() -> None:
    # Whichever two elements Triton hands one instance, each half is nibble 2p of its own input
    # minus its own zero point: here two unrelated words (neither shifted) and two zero points.
    words, zeros = (0x89ABCDEF, 0x01234567), (3.0, 11.0)
    offsets = [-(128.0 + z) for z in zeros]
    registers = {"$4": words[0], "$5": words[1], "$6": packed(offsets, torch.bfloat16)}
    out = run_asm(ASM[torch.bfloat16].value, registers, torch.bfloat16)
    for p in range(4):
        expected = [((w >> 8 * p) & 0xF) - z for w, z in zip(words, zeros, strict=True)]
        assert halves(out[f"${p}"], torch.bfloat16) == expected


def test_the_e4m3_word_asm_gives_each_byte_in_fp16_in_order() -> None:
    generator = random.Random(1)
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = [b for b in range(256) if not e4m3[b].float().isnan()]  # the cache saturates
    asm = triton_decode_attention._E4M3_WORD_ASM.value
    for _ in range(200):
        values = [generator.choice(finite) for _ in range(4)]
        word = sum(b << 8 * i for i, b in enumerate(values))
        out = run_asm(asm, {"$4": word}, torch.float16)
        got = [halves(out[f"${i}"], torch.float16)[0] for i in range(4)]  # 16-bit outputs
        assert got == [e4m3[b].float().item() for b in values]
