"""Quantized checkpoints into the layouts kvflow's kernels read.

Each format stores a quantized projection as a few tensors under its module name; they are
gathered per module as the checkpoint streams (a module's parts may sit in different files)
and translated: int4 formats into `qweight`, `scales`, `zeros` and `g_idx` (`kernels/int4.py`
has the layout), FP8 into `qweight` and a float32 `weight_scale` per output channel (what
`ops.fp8_linear` reads). Everything else passes through unchanged. The formats, as their
writers define them:

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

from collections.abc import Iterable, Iterator

import torch

from kernels.fp8 import expand_block_scales
from kernels.int4 import pack_weight, transpose_chunks, unpack_int4
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


def translate_quantized(
    tensors: Iterable[tuple[str, torch.Tensor]], names: set[str], spec: QuantSpec
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) stream with each quantized module's parts replaced by
    the kernels' layout, yielded once all its parts (known from `names`) have been seen."""
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
    pending: dict[str, dict[str, torch.Tensor]] = {}
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


def _checked_group_index(g_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    g_idx = g_idx.to(torch.int32)
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups):
        raise ValueError(f"g_idx holds groups outside 0..{num_groups - 1}")
    return g_idx


def _trivial_groups(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether g_idx is column // group_size, which the kernels compute without it."""
    k = g_idx.numel()
    return group_size > 0 and torch.equal(g_idx.long(), torch.arange(k) // group_size)


def _awq(parts: dict[str, torch.Tensor], spec: QuantSpec) -> dict[str, torch.Tensor | None]:
    k = parts["qweight"].shape[0]
    q = _unpack_awq(parts["qweight"])  # [K, N]
    zeros = None
    if "qzeros" in parts and not spec.symmetric:
        zeros = _unpack_awq(parts["qzeros"]).t().contiguous()  # [N, G]
    elif not spec.symmetric:
        raise ValueError("AWQ with zero_point needs qzeros")
    elif "qzeros" in parts:
        _check_symmetric_zeros(parts["qzeros"], stored=8)
    _check_groups(k, parts["scales"].shape[0], spec)
    return {
        "qweight": pack_weight(q.t()),
        "scales": parts["scales"].t().contiguous(),
        "zeros": zeros,
    }


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:  # [R, N/8] int32 -> [R, N] uint8
    nibbles = unpack_int4(packed).reshape(packed.shape[0], -1, 8)  # [R, N/8, 8]
    return nibbles[..., _AWQ_COLUMN_NIBBLE].reshape(packed.shape[0], -1)


def _gptq(parts: dict[str, torch.Tensor], spec: QuantSpec) -> dict[str, torch.Tensor | None]:
    qweight = parts["qweight"]  # [K/8, N]: transposed, plain nibbles along K
    k, num_groups = qweight.shape[0] * 8, parts["scales"].shape[0]
    zeros = None
    if not spec.symmetric:
        zeros = unpack_int4(parts["qzeros"])  # [G, N]
        if spec.zeros_minus_one:
            zeros = (zeros + 1) & 0xF
        zeros = zeros.t().contiguous()
    elif spec.zeros_minus_one:
        _check_symmetric_zeros(parts["qzeros"], stored=7)
    g_idx = parts.get("g_idx")
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
    return {
        "qweight": transpose_chunks(qweight.t()),
        "scales": parts["scales"].t().contiguous(),
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


def _compressed_tensors(
    parts: dict[str, torch.Tensor], spec: QuantSpec
) -> dict[str, torch.Tensor | None]:
    n, k = (int(v) for v in parts["weight_shape"].tolist())
    packed = parts["weight_packed"]  # [N, K/8]: plain nibbles along K (signed + 8)
    if packed.shape != (n, k // 8) or k % 8:
        raise ValueError(f"weight_packed {tuple(packed.shape)} does not hold weight_shape {n, k}")
    num_groups = parts["weight_scale"].shape[1]
    zeros = None
    if not spec.symmetric:
        if "weight_zero_point" not in parts:
            raise ValueError("an asymmetric scheme needs weight_zero_point")
        packed_zeros = parts["weight_zero_point"]
        if packed_zeros.dtype != torch.int32 or packed_zeros.shape != ((n + 7) // 8, num_groups):
            raise ValueError(
                f"weight_zero_point {packed_zeros.dtype} {tuple(packed_zeros.shape)} is not "
                f"int32 [{(n + 7) // 8}, {num_groups}] (packed along the output channels)"
            )
        zeros = unpack_int4(packed_zeros.t())[:, :n].t().contiguous()  # [N, G]
    g_idx = parts.get("weight_g_idx")
    if g_idx is not None:
        g_idx = _checked_group_index(g_idx, num_groups)
    else:
        _check_groups(k, num_groups, spec)
    return {
        "qweight": transpose_chunks(packed),
        "scales": parts["weight_scale"].contiguous(),
        "zeros": zeros,
        "g_idx": g_idx,
    }


def _check_groups(k: int, num_groups: int, spec: QuantSpec) -> None:
    group = spec.group_size if spec.group_size > 0 else k
    if num_groups * group != k:
        raise ValueError(f"{num_groups} scale groups of {group} do not cover {k} input columns")


def _fp8(parts: dict[str, torch.Tensor], spec: QuantSpec) -> dict[str, torch.Tensor | None]:
    weight = parts["weight"]
    scale = parts["weight_scale" if "weight_scale" in parts else "weight_scale_inv"].float()
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"an FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if spec.fp8_block is not None:
        return {"qweight": weight, "weight_scale": _row_group_scales(scale, weight, spec.fp8_block)}
    n = weight.shape[0]
    if scale.numel() == 1:  # one scale for the tensor: the same for every output channel
        scale = scale.reshape(1).expand(n)
    elif scale.numel() == n:
        scale = scale.reshape(n)
    else:
        raise ValueError(
            f"weight_scale {tuple(parts['weight_scale'].shape)} is neither per tensor nor per "
            f"output channel of weight {tuple(weight.shape)}, and the config names no block size"
        )
    scale = scale.contiguous()
    translated: dict[str, torch.Tensor | None] = {"qweight": weight, "weight_scale": scale}
    if spec.static_input:
        input_scale = parts["input_scale"].float()
        if input_scale.numel() != 1:
            raise ValueError(
                f"input_scale {tuple(input_scale.shape)}: static activations need one scale "
                "per tensor"
            )
        translated["input_scale"] = input_scale.reshape(1).expand(n).contiguous()
    return translated


def _row_group_scales(
    scale: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:  # [N, K / columns]
    """A scale per [rows, columns] block -> one per output row and group of columns."""
    (n, k), (rows, cols) = weight.shape, block
    if k % cols:
        raise ValueError(f"weight {tuple(weight.shape)}: K is not a multiple of the block's {cols}")
    if tuple(scale.shape) != (-(-n // rows), k // cols):
        raise ValueError(
            f"block scales {tuple(scale.shape)} do not tile weight {tuple(weight.shape)} in "
            f"blocks of {list(block)}"
        )
    return expand_block_scales(scale, rows, n)


_TRANSLATE = {
    "awq": _awq,
    "gptq": _gptq,
    "compressed-tensors": _compressed_tensors,
    "fp8": _fp8,
    "fp8_block": _fp8,
}
