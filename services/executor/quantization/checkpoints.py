"""Quantized checkpoints into the layouts kvflow's kernels read.

Each format stores a quantized projection as a few tensors under its module name; they are
gathered per module as the checkpoint streams (a module's parts may sit in different files)
and translated: int4 formats into `qweight`, `scales`, `zeros` and `g_idx` (`kernels/int4.py`
has the layout), FP8 into `qweight` and a float32 `weight_scale` per output channel (what
`quantized_ops.fp8_linear` reads). Everything else passes through unchanged. A translated tensor is
not read when translated: it is a `CheckpointSlice` whose cut reads only the checkpoint
entries behind that cut (whole packed words, groups, blocks) and translates them, so that a
tensor-parallel rank reads only its share of the file. The formats, as their writers define
them:

  AWQ (GEMM)   qweight [K, N/8] and qzeros [G, N/8] int32, packed along N in the order
               0 2 4 6 1 3 5 7 (the value of column 8j + order[i] at bits 4i); scales [G, N].
  GPTQ         qweight [K/8, N] packed along K in natural order, qzeros [G, N/8] along N;
               scales [G, N]; g_idx [K]. The original format stores each zero minus one.
  compressed-  weight_packed [N, K/8], along K in natural order, of the signed value + 8;
  tensors      weight_scale [N, G]; weight_zero_point [ceil(N/8), G] packed along N (signed
  (int4)       + 8), when asymmetric; weight_g_idx [K] with group act-order; weight_shape.
  FP8          weight [N, K] float8_e4m3fn with weight_scale: one per tensor ([] or [1]) or
               per output channel ([N, 1]); w = weight * weight_scale. input_scale ([] or
               [1]): the calibrated scale of the layer's input, x ~ q * input_scale, read
               when the config says static activations (kept per output row, like a scale
               per tensor, so that fused pieces keep theirs) and ignored otherwise (some
               tools write it for dynamic ones too). With block scales, one per [rows,
               columns] block: weight_scale_inv (transformers) or weight_scale
               (compressed-tensors) [ceil(N / rows), K / columns], kept as one per output
               row and group of columns (`kernels/fp8.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from fractions import Fraction
from types import EllipsisType
from typing import NamedTuple

import torch

from kernels.fp8 import expand_block_scales
from kernels.int4 import pack_weight, transpose_chunks, unpack_int4
from services.executor.parallel.shards import CheckpointSlice, Loaded, read
from shared.quant_config import QuantSpec

# The parts that make up one quantized module, by format: (the part that marks a module as
# quantized, the required parts, the optional ones).
PARTS = {
    "awq": ("qweight", {"qweight", "scales"}, {"qzeros"}),
    "gptq": ("qweight", {"qweight", "scales", "qzeros"}, {"g_idx"}),
    "compressed-tensors": (
        "weight_packed",
        {"weight_packed", "weight_scale", "weight_shape"},
        {"weight_zero_point", "weight_g_idx"},
    ),
    "fp8": ("weight_scale", {"weight", "weight_scale"}, {"input_scale"}),
    "fp8_block": ("weight_scale_inv", {"weight", "weight_scale_inv"}, {"input_scale"}),
}
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column _AWQ_ORDER[i]
_AWQ_COLUMN_NIBBLE = [_AWQ_ORDER.index(c) for c in range(8)]  # column c sits in this nibble
Translated = dict[str, Loaded | None]  # a module's tensors in the kernels' layout


def translate_quantized(
    tensors: Iterable[tuple[str, Loaded]], names: set[str], spec: QuantSpec
) -> Iterator[tuple[str, Loaded]]:
    """The checkpoint's (name, tensor) stream with each quantized module's parts replaced by
    the kernels' layout, yielded once all its parts (known from `names`) have been seen.
    What is translated is read when it is cut or read (`CheckpointSlice`), not here."""
    marker, required, optional = PARTS[spec.checkpoint_format]
    if spec.static_input:
        required = required | {"input_scale"}
    quantized = {name.rpartition(".")[0] for name in names if name.endswith(f".{marker}")}
    expected: dict[str, set[str]] = {}
    for name in names:
        module, _, part = name.rpartition(".")
        if module in quantized and part in required | optional:
            expected.setdefault(module, set()).add(part)
    for module, parts in expected.items():
        if not required <= parts:
            raise ValueError(f"{module}: the checkpoint lacks {sorted(required - parts)}")
    pending: dict[str, dict[str, Loaded]] = {}
    for name, tensor in tensors:
        module, _, part = name.rpartition(".")
        if module not in expected or part not in expected[module]:
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if set(parts) == expected[module]:
            del pending[module]
            for key, value in _TRANSLATE[spec.checkpoint_format](parts, spec).items():
                if value is not None:
                    yield f"{module}.{key}", value


class Axis(NamedTuple):
    """Where a dimension of a translated tensor lies in the checkpoint tensor it comes from."""

    dim: int | None  # the checkpoint tensor's dimension; None: one value for every entry
    per: Fraction = Fraction(1)  # translated entries per checkpoint entry along it


class _Translated:
    """One tensor of a quantized module in the kernels' layout, not read yet (a part that
    `CheckpointSlice` reads): a cut of it reads only the checkpoint entries behind the cut
    (the packed words, groups or blocks holding it) and translates those, so that a
    tensor-parallel rank reads only its share of the file."""

    def __init__(
        self,
        source: Loaded,
        shape: Sequence[int],
        axes: Sequence[Axis],
        convert: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.source, self.shape, self.axes, self.convert = source, list(shape), axes, convert

    def get_shape(self) -> list[int]:
        return self.shape

    def __getitem__(self, index: tuple[slice, ...] | EllipsisType) -> torch.Tensor:
        cuts = [slice(0, n) for n in self.shape]
        if isinstance(index, tuple):
            cuts = [slice(*s.indices(n)[:2]) for s, n in zip(index, self.shape, strict=True)]
        source, offsets = self.source, [0] * len(self.shape)
        for dim, (cut, axis) in enumerate(zip(cuts, self.axes, strict=True)):
            if axis.dim is None or (cut.start, cut.stop) == (0, self.shape[dim]):
                continue
            first, last = math.floor(cut.start / axis.per), math.ceil(cut.stop / axis.per)
            source = source.narrow(axis.dim, first, last - first)
            offsets[dim] = int(first * axis.per)
        value = self.convert(read(source))  # may run past the shape: padding words, blocks
        kept = zip(cuts, offsets, strict=True)
        return value[tuple(slice(c.start - o, c.stop - o) for c, o in kept)]


def _lazy(
    source: Loaded,
    shape: Sequence[int],
    axes: Sequence[Axis],
    convert: Callable[[torch.Tensor], torch.Tensor],
) -> CheckpointSlice:
    return CheckpointSlice(_Translated(source, shape, axes, convert))


def _transposed(tensor: Loaded) -> CheckpointSlice:  # [A, B] -> [B, A]
    rows, cols = tensor.shape
    return _lazy(tensor, (cols, rows), (Axis(1), Axis(0)), lambda t: t.t().contiguous())


def _checked_group_index(g_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    g_idx = g_idx.to(torch.int32)
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups):
        raise ValueError(f"g_idx holds groups outside 0..{num_groups - 1}")
    return g_idx


def _trivial_groups(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether g_idx is column // group_size, which the kernels compute without it."""
    k = g_idx.numel()
    return group_size > 0 and torch.equal(g_idx.long(), torch.arange(k) // group_size)


def _awq(parts: dict[str, Loaded], spec: QuantSpec) -> Translated:
    qweight, scales = parts["qweight"], parts["scales"]  # [K, N/8], [G, N]
    (k, words), num_groups = qweight.shape, scales.shape[0]
    n = words * 8
    zeros = None
    if "qzeros" in parts and not spec.symmetric:
        # [G, N/8] -> [N, G]
        axes = (Axis(1, Fraction(8)), Axis(0))
        zeros = _lazy(parts["qzeros"], (n, num_groups), axes, lambda z: _unpack_awq(z).t())
    elif not spec.symmetric:
        raise ValueError("AWQ with zero_point needs qzeros")
    elif "qzeros" in parts:
        _check_symmetric_zeros(read(parts["qzeros"]), stored=8)
    _check_groups(k, num_groups, spec)
    # [K, N/8] -> [N, K/8]: a word of ours holds 8 of the checkpoint's rows
    axes = (Axis(1, Fraction(8)), Axis(0, Fraction(1, 8)))
    return {
        "qweight": _lazy(qweight, (n, k // 8), axes, lambda q: pack_weight(_unpack_awq(q).t())),
        "scales": _transposed(scales),
        "zeros": zeros,
    }


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:  # [R, N/8] int32 -> [R, N] uint8
    nibbles = unpack_int4(packed).reshape(packed.shape[0], -1, 8)  # [R, N/8, 8]
    return nibbles[..., _AWQ_COLUMN_NIBBLE].reshape(packed.shape[0], -1)


def _gptq(parts: dict[str, Loaded], spec: QuantSpec) -> Translated:
    qweight = parts["qweight"]  # [K/8, N]: transposed, plain nibbles along K
    (words, n), num_groups = qweight.shape, parts["scales"].shape[0]
    k = words * 8
    zeros = None
    if not spec.symmetric:
        minus_one = spec.zeros_minus_one

        def gptq_zeros(packed: torch.Tensor) -> torch.Tensor:  # [G, N/8] -> [N, G]
            zeros = unpack_int4(packed)
            return ((zeros + 1) & 0xF if minus_one else zeros).t()

        axes = (Axis(1, Fraction(8)), Axis(0))
        zeros = _lazy(parts["qzeros"], (n, num_groups), axes, gptq_zeros)
    elif spec.zeros_minus_one:
        _check_symmetric_zeros(read(parts["qzeros"]), stored=7)
    g_idx = read(parts["g_idx"]) if "g_idx" in parts else None  # [K]: small, read whole
    if spec.act_order and g_idx is None:
        raise ValueError("quantization_config says desc_act, but the checkpoint has no g_idx")
    if g_idx is not None:
        g_idx = _checked_group_index(g_idx, num_groups)
    if g_idx is not None and not spec.act_order:
        # Written by every GPTQ tool; without act-order it must be column // group_size,
        # which the kernels compute, so it is dropped.
        if not _trivial_groups(g_idx, spec.group_size if spec.group_size > 0 else k):
            raise ValueError("g_idx is not in column order, but desc_act is false")
        g_idx = None
    if g_idx is None:
        _check_groups(k, num_groups, spec)
    axes = (Axis(1), Axis(0))  # [K/8, N] -> [N, K/8]
    return {
        "qweight": _lazy(qweight, (n, words), axes, lambda q: transpose_chunks(q.t())),
        "scales": _transposed(parts["scales"]),
        "zeros": zeros,
        "g_idx": g_idx,
    }


def _check_symmetric_zeros(qzeros: torch.Tensor, stored: int) -> None:
    """A symmetric checkpoint's stored zero points must all say 8 (GPTQ's original format
    stores 7): kvflow drops them, so a file that disagrees with its config would run with
    wrong weights."""
    if not bool((unpack_int4(qzeros) == stored).all()):
        raise ValueError(
            "quantization_config says symmetric, but the checkpoint's zero points are not 8"
        )


def _compressed_tensors(parts: dict[str, Loaded], spec: QuantSpec) -> Translated:
    n, k = (int(v) for v in read(parts["weight_shape"]).tolist())
    packed = parts["weight_packed"]  # [N, K/8]: plain nibbles along K (signed + 8)
    if tuple(packed.shape) != (n, k // 8) or k % 8:
        raise ValueError(f"weight_packed {tuple(packed.shape)} does not hold weight_shape {n, k}")
    num_groups = parts["weight_scale"].shape[1]
    zeros = None
    if not spec.symmetric:
        if "weight_zero_point" not in parts:
            raise ValueError("an asymmetric scheme needs weight_zero_point")
        packed_zeros = parts["weight_zero_point"]
        described = f"int32 [{(n + 7) // 8}, {num_groups}] (packed along the output channels)"
        if tuple(packed_zeros.shape) != ((n + 7) // 8, num_groups):
            raise ValueError(f"weight_zero_point {tuple(packed_zeros.shape)} is not {described}")

        def ct_zeros(packed: torch.Tensor) -> torch.Tensor:  # [N/8, G] -> [N, G]
            if packed.dtype != torch.int32:
                raise ValueError(f"weight_zero_point {packed.dtype} is not {described}")
            return unpack_int4(packed.t()).t()

        axes = (Axis(0, Fraction(8)), Axis(1))
        zeros = _lazy(packed_zeros, (n, num_groups), axes, ct_zeros)
    g_idx = read(parts["weight_g_idx"]) if "weight_g_idx" in parts else None
    if g_idx is not None:
        g_idx = _checked_group_index(g_idx, num_groups)
    else:
        _check_groups(k, num_groups, spec)
    return {
        "qweight": _lazy(packed, (n, k // 8), (Axis(0), Axis(1)), transpose_chunks),
        "scales": parts["weight_scale"],  # [N, G], as the kernels read it
        "zeros": zeros,
        "g_idx": g_idx,
    }


def _check_groups(k: int, num_groups: int, spec: QuantSpec) -> None:
    group = spec.group_size if spec.group_size > 0 else k
    if num_groups * group != k:
        raise ValueError(f"{num_groups} scale groups of {group} do not cover {k} input columns")


def _fp8(parts: dict[str, Loaded], spec: QuantSpec) -> Translated:
    weight = parts["weight"]
    scale_name = "weight_scale" if "weight_scale" in parts else "weight_scale_inv"
    scale = parts[scale_name]
    n, k = weight.shape
    qweight = _lazy(weight, (n, k), (Axis(0), Axis(1)), _fp8_weight)
    if spec.fp8_block is not None:
        return {"qweight": qweight, "weight_scale": _row_group_scales(scale, n, k, spec.fp8_block)}
    if math.prod(scale.shape) == 1:  # one scale for the tensor: the same for every channel
        per_channel = _lazy(scale, (n,), (Axis(None),), lambda s: s.float().reshape(1).expand(n))
    elif math.prod(scale.shape) == n:  # [N], [N, 1] or [1, N]: cut along the N
        along = list(scale.shape).index(n)
        per_channel = _lazy(scale, (n,), (Axis(along),), lambda s: s.float().reshape(-1))
    else:
        raise ValueError(
            f"{scale_name} {tuple(scale.shape)} is neither per tensor nor per output channel "
            f"of weight {(n, k)}, and the config names no block size"
        )
    translated: Translated = {"qweight": qweight, "weight_scale": per_channel}
    if spec.static_input:
        input_scale = parts["input_scale"]
        if math.prod(input_scale.shape) != 1:
            raise ValueError(
                f"input_scale {tuple(input_scale.shape)}: static activations need one scale "
                "per tensor"
            )
        # kept per output row, like a scale per tensor, so that fused pieces keep theirs
        axes = (Axis(None),)
        translated["input_scale"] = _lazy(
            input_scale, (n,), axes, lambda s: s.float().reshape(1).expand(n)
        )
    return translated


def _fp8_weight(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"an FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    return weight


def _row_group_scales(scale: Loaded, n: int, k: int, block: tuple[int, int]) -> CheckpointSlice:
    """A scale per [rows, columns] block -> one per output row and group of columns
    [N, K / columns] (`kernels/fp8.py`)."""
    rows, cols = block
    if k % cols:
        raise ValueError(f"weight {(n, k)}: K is not a multiple of the block's {cols}")
    if tuple(scale.shape) != (-(-n // rows), k // cols):
        raise ValueError(
            f"block scales {tuple(scale.shape)} do not tile weight {(n, k)} in blocks of "
            f"{list(block)}"
        )

    def per_row(blocks: torch.Tensor) -> torch.Tensor:  # every row of the blocks read
        return expand_block_scales(blocks.float(), rows, blocks.shape[0] * rows)

    axes = (Axis(0, Fraction(rows)), Axis(1))
    return _lazy(scale, (n, k // cols), axes, per_row)


_TRANSLATE: dict[str, Callable[[dict[str, Loaded], QuantSpec], Translated]] = {
    "awq": _awq,
    "gptq": _gptq,
    "compressed-tensors": _compressed_tensors,
    "fp8": _fp8,
    "fp8_block": _fp8,
}
