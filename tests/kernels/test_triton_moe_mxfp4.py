"""MXFP4 experts (gpt-oss's) in the int4 experts' grouped GEMMs (kernels/triton_moe_int4.py,
`Int4Stack.e2m1`), with gpt-oss's biases and clamped SwiGLU, against the torch reference on
the weights the codes stand for. On the CPU under the Triton interpreter (small shapes); on
the GPU at gpt-oss-20b's shape."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import triton_moe_int4_gemv
from kernels.int4 import Int4Stack
from kernels.moe import (
    ClampedSwiglu,
    ExpertBiases,
    moe_experts_int4_reference,
    moe_experts_reference,
    moe_route_reference,
)
from kernels.mxfp4 import E2M1_VALUES, as_int4_layout, dequantize_4bit_stack, dequantize_mxfp4
from kernels.triton_moe_int4 import moe_experts_int4, moe_experts_int4_grouped
from kernels.triton_moe_int4_gemv import Int4GemvTiles, moe_experts_int4_gemv, uses_int4_gemv
from tests.kernels.expert_parallel import another_ranks, nan_empty, nan_expert_0
from tests.quantized_writers import mxfp4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SWIGLU = ClampedSwiglu(limit=7.0)  # gpt-oss's
# Wide rows and narrow K steps (64 and 32 columns: two a pair here): the interpreter's cost is by
# program and by element, masked ones included (0.4 s a call against 3 s with MXFP4's tiles).
STEPPED = Int4GemvTiles(gate_up_n=64, gate_up_words=8, down_n=128, down_words=4, num_warps=1)


@pytest.fixture(autouse=True)
def interpreted_gemv_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE == "cpu":
        monkeypatch.setattr(triton_moe_int4_gemv, "MXFP4_GEMV_TILES", STEPPED)


def mxfp4_stack(experts: int, rows: int, cols: int, generator: torch.Generator) -> Int4Stack:
    """Random float experts rounded to MXFP4 as gpt-oss's checkpoints are, in the kernels'
    layout; every code occurs (the groups' spread reaches each e2m1 value)."""
    weight = torch.randn(experts, rows, cols, generator=generator, device=generator.device)
    blocks, scales, _ = mxfp4(weight * 0.05)
    qweight, values = as_int4_layout(blocks, scales)
    return Int4Stack(qweight.to(DEVICE), values.to(DEVICE), None, 32, e2m1=True)


def routed(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=generator)
    return moe_route_reference(logits.to(DEVICE), top_k, renormalize=True)


def biases_of(experts: int, hidden: int, inter: int, generator: torch.Generator) -> ExpertBiases:
    device = generator.device
    gate_up = torch.randn(experts, 2 * inter, generator=generator, device=device) * 0.5
    down = torch.randn(experts, hidden, generator=generator, device=device) * 0.1
    return ExpertBiases(gate_up.to(DEVICE), down.to(DEVICE))


def test_the_layout_keeps_every_code_and_scale() -> None:
    """as_int4_layout moves the checkpoint's nibbles, not their meaning: the stack
    dequantizes to exactly what the blocks and scales stand for, all 16 codes included."""
    generator = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, 8, 3, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 140, (2, 8, 3), dtype=torch.uint8, generator=generator)
    qweight, values = as_int4_layout(blocks, scales)
    stack = Int4Stack(qweight, values, None, 32, e2m1=True)
    expected = dequantize_mxfp4(blocks, scales)
    assert torch.equal(dequantize_4bit_stack(stack, torch.float32), expected)
    assert set(expected.div(values.float().repeat_interleave(32, -1)).unique().tolist()) == set(
        E2M1_VALUES
    )


@pytest.mark.parametrize(
    ("tokens", "experts", "with_biases", "gemv"),
    [
        (1, 32, True, True),  # one token, few of many experts: the GEMVs, gpt-oss's epilogues
        (2, 8, False, True),  # half the experts chosen: the GEMVs still, MXFP4 alone
        (4, 8, True, True),  # as many pairs as experts: the GEMVs' last count
        (3, 4, True, False),  # more pairs than experts: the grouped GEMMs
        (9, 4, True, False),  # several blocks' pairs, gpt-oss's epilogues
        (6, 4, False, False),  # MXFP4 alone, silu(gate) * up
    ],
)
def test_mxfp4_experts_match_the_reference(
    tokens: int, experts: int, with_biases: bool, gemv: bool
) -> None:
    hidden, inter, top_k = 128, 64, 2
    assert uses_int4_gemv(tokens * top_k, experts, e2m1=True) == gemv
    generator = torch.Generator().manual_seed(tokens)
    gate_up = mxfp4_stack(experts, 2 * inter, hidden, generator)
    down = mxfp4_stack(experts, hidden, inter, generator)
    biases = biases_of(experts, hidden, inter, generator) if with_biases else None
    swiglu = SWIGLU if with_biases else None
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    weights, ids = routed(tokens, experts, top_k, seed=tokens)
    out = moe_experts_int4(x, gate_up, down, weights, ids, biases, swiglu)
    expected = moe_experts_int4_reference(x, gate_up, down, weights, ids, biases, swiglu)
    float_weights = (dequantize_4bit_stack(gate_up, x.dtype), dequantize_4bit_stack(down, x.dtype))
    on_floats = moe_experts_reference(x, *float_weights, weights, ids, biases=biases, swiglu=swiglu)
    assert torch.equal(expected, on_floats)
    scale = float(expected.abs().max())  # float32 dots in full precision on the GPU too
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-4 * scale)
    if gemv:  # two K steps a pair (on the GPU too): each pair's down bias added once
        stepped = moe_experts_int4_gemv(x, gate_up, down, weights, ids, STEPPED, biases, swiglu)
        torch.testing.assert_close(stepped, expected, rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.parametrize(("tokens", "experts"), [(2, 32), (9, 4)], ids=["gemv", "grouped"])
def test_another_ranks_mxfp4_pairs_add_nothing(
    tokens: int, experts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expert parallelism on gpt-oss: a choice of expert -1 (another rank's) adds nothing, its
    down bias included, and reads nothing, in the GEMVs and the grouped GEMMs (told
    `partial`): expert 0 has NaN scales and biases, and every torch.empty buffer starts as NaN
    (tests/kernels/expert_parallel.py). Routing here may choose expert 0: its choices are
    made another rank's."""
    nan_empty(monkeypatch)
    hidden, inter, top_k = 128, 64, 2
    generator = torch.Generator().manual_seed(tokens)
    gate_up = mxfp4_stack(experts, 2 * inter, hidden, generator)
    down = mxfp4_stack(experts, hidden, inter, generator)
    biases = biases_of(experts, hidden, inter, generator)
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    weights, ids = routed(tokens, experts, top_k, seed=tokens)
    ids = torch.where(ids == 0, -1, another_ranks(ids))
    expected = moe_experts_int4_reference(x, gate_up, down, weights, ids, biases, SWIGLU)
    gate_up, down = (s._replace(scales=nan_expert_0(s.scales)) for s in (gate_up, down))
    biases = ExpertBiases(*(nan_expert_0(b) for b in biases))
    out = moe_experts_int4(x, gate_up, down, weights, ids, biases, SWIGLU)
    assert uses_int4_gemv(tokens * top_k, experts, e2m1=True) == (experts >= 32)
    scale = float(expected.abs().max())
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-4 * scale)


def test_mxfp4_experts_refuse_zero_points_and_other_groups() -> None:
    generator = torch.Generator().manual_seed(0)
    gate_up = mxfp4_stack(2, 64, 64, generator)
    down = mxfp4_stack(2, 64, 32, generator)
    weights, ids = routed(3, 2, 1, seed=0)
    x = torch.randn(3, 64, device=DEVICE)
    zeros = torch.zeros_like(down.scales, dtype=torch.uint8)
    with pytest.raises(ValueError, match="MXFP4 experts have no zero points"):
        moe_experts_int4(x, gate_up, down._replace(zeros=zeros), weights, ids)


@pytest.mark.skipif(DEVICE == "cpu", reason="16-bit tensor-core dots: on the GPU")
@pytest.mark.parametrize(
    ("tokens", "inter"),
    [(1, 2880), (4, 2880), (64, 2880), (1024, 2880), (1, 1440), (64, 1440)],
)
def test_mxfp4_experts_in_bf16_at_gpt_oss_20bs_shape(tokens: int, inter: int) -> None:
    """gpt-oss-20b's experts: 32 of 2880 columns over 2880, top 4, biases, clamped SwiGLU;
    or a rank's of two (1,440 columns: the down projection's last K step of 64 masked)."""
    hidden, experts, top_k = 2880, 32, 4
    generator = torch.Generator(DEVICE).manual_seed(tokens)  # 0.8 G weights: made on the GPU
    gate_up = mxfp4_stack(experts, 2 * inter, hidden, generator)
    down = mxfp4_stack(experts, hidden, inter, generator)
    biases = biases_of(experts, hidden, inter, generator)
    biases = ExpertBiases(*(b.to(torch.bfloat16) for b in biases))
    x = torch.randn(tokens, hidden, generator=generator, device=DEVICE).to(torch.bfloat16)
    weights, ids = routed(tokens, experts, top_k, seed=tokens)
    out = moe_experts_int4(x, gate_up, down, weights, ids, biases, SWIGLU)
    expected = moe_experts_int4_reference(x, gate_up, down, weights, ids, biases, SWIGLU)
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2 * scale)
    if uses_int4_gemv(tokens * top_k, experts, e2m1=True):  # the grouped GEMMs take them too
        grouped = moe_experts_int4_grouped(x, gate_up, down, weights, ids, biases=biases,
                                           swiglu=SWIGLU)  # fmt: skip
        torch.testing.assert_close(grouped.float(), expected.float(), rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.skipif(DEVICE == "cpu", reason="inline PTX: on the GPU")
def test_e2m1_pairs_make_every_code_times_every_kind_of_scale_exactly() -> None:
    """The PTX that the GPU's bf16 path decodes with (kernels/int4_pairs.py): each nibble of
    a word times its scale, bit for bit the bf16 of e2m1 value times scale, for all 16 codes
    and scales from 2 ** -127 (a subnormal) through 2 ** 8, and e8m0's NaN."""
    import triton
    import triton.language as tl

    from kernels.triton_e2m1 import e2m1_pairs

    @triton.jit
    def decode(packed_ptr, scale_ptr, out_ptr, ROWS: tl.constexpr, WORDS: tl.constexpr):
        at = tl.arange(0, ROWS)[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
        pairs = e2m1_pairs(tl.load(packed_ptr + at), tl.load(scale_ptr + at))
        for p in tl.static_range(4):  # nibbles 2p and 2p + 1 of each word
            low, high = tl.split(pairs[p])
            tl.store(out_ptr + at * 8 + 2 * p, low)
            tl.store(out_ptr + at * 8 + 2 * p + 1, high)

    rows, words = 64, 16
    generator = torch.Generator().manual_seed(0)
    nibbles = torch.randint(0, 16, (rows, words, 8), generator=generator)
    nibbles[0, 0] = torch.arange(8)
    nibbles[0, 1] = torch.arange(8, 16)
    packed = (nibbles << (4 * torch.arange(8))).sum(-1).to(torch.int64)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    exponents = torch.randint(-127, 9, (rows, words), generator=generator).float()
    exponents[0, :2] = -127.0
    scale = torch.exp2(exponents).to(torch.bfloat16)
    scale[1, 0] = torch.nan
    out = torch.empty(rows, words, 8, dtype=torch.bfloat16, device=DEVICE)
    decode[(1,)](packed.to(DEVICE), scale.to(DEVICE), out, ROWS=rows, WORDS=words)
    values = torch.tensor(E2M1_VALUES)[nibbles] * scale.float()[..., None]
    expected = values.to(torch.bfloat16)
    assert torch.equal(out.cpu().isnan(), expected.isnan())
    same = out.cpu().view(torch.int16) == expected.view(torch.int16)
    assert (same | expected.isnan()).all()
