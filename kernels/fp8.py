"""FP8 (e4m3) W8A8 linear layers: the torch references.

Weights are quantized once, per output channel (a scale per row of [N, K]); activations per
token (a scale per row of [M, K]) from their absolute maximum, by the op that makes them
(`Fp8Rows`) or the layer, or by a checkpoint's static scale. The product is
the float product of the dequantized operands, so the reference is exact up to the float32
sum's order, and any faster path (cuBLASLt's `_scaled_mm`, a Triton kernel) is checked
against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# A row of zeros still gets a usable scale (any tiny positive value: 0 / scale stays 0).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_fp8_rowwise_reference(
    x: torch.Tensor,  # [R, C]
    static_scale: torch.Tensor | None = None,  # [1] float32: a checkpoint's calibrated scale
) -> tuple[torch.Tensor, torch.Tensor]:  # ([R, C] float8_e4m3fn, [R, 1] float32)
    """Each row scaled into e4m3's range by its absolute maximum (x ≈ q * scale), or by the
    static scale, past which values saturate at ±448."""
    if static_scale is None:
        scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def check_static_scale(scale: torch.Tensor | None) -> None:
    """A checkpoint's static activation scale is one float32 (or None: scales per token)."""
    if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32):
        raise ValueError(f"a static scale is one float32, got {scale.dtype} {tuple(scale.shape)}")


@dataclass(frozen=True)
class Fp8Rows:
    """An activation already quantized per token, as the op that produced it (an RMSNorm, the
    SiLU-and-mul) hands it to an FP8 layer: one pass over it saved. x ~ q * scale."""

    q: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M, 1] float32
    dtype: torch.dtype  # the float dtype it was computed in, and the layer returns

    @classmethod
    def quantize(cls, x: torch.Tensor, static_scale: torch.Tensor | None = None) -> Fp8Rows:
        """The reference's quantization of a float activation [M, K]."""
        return cls(*quantize_fp8_rowwise_reference(x, static_scale), x.dtype)


def fp8_linear_reference(
    x: torch.Tensor | Fp8Rows,  # [M, K], bf16/fp16/fp32, or already quantized per token
    qweight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
    input_scale: torch.Tensor | None = None,  # [1]: x's static scale (else one per token)
) -> torch.Tensor:  # [M, N], in x's (float) dtype
    """x quantized per token (or by its static scale), times the dequantized weight, in
    float32."""
    if isinstance(x, Fp8Rows) and input_scale is not None:
        raise ValueError("x is quantized already: its producer chose the scales")
    rows = x if isinstance(x, Fp8Rows) else Fp8Rows.quantize(x, input_scale)
    out = (rows.q.float() @ qweight.float().t()) * rows.scale * weight_scale[None, :]  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(rows.dtype)


# -- Block-scaled FP8 (DeepSeek-V3 style, `weight_block_size` [bn, bk]) ----------------------
# The checkpoint's scale per [bn, bk] block of the weight is stored per output row, one per
# group of bk input columns: weight_scale [N, K / bk] (a block's scale repeated over its bn
# rows; services/executor/quantization/checkpoints.py expands it), so fused projections split
# their rows like any per-row tensor. Activations are quantized per token and per group of bk
# columns at each call, so the product sums each group's FP8 products and scales them by both.


def quantize_fp8_groupwise_reference(
    x: torch.Tensor,  # [R, C], C a multiple of group
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([R, C] float8_e4m3fn, [R, C / group] float32)
    """Each group of `group` columns of each row scaled by its absolute maximum."""
    rows, cols = x.shape
    if cols % group:
        raise ValueError(f"{cols} columns are not a multiple of the FP8 group of {group}")
    groups = x.float().reshape(rows, cols // group, group)
    scale = (groups.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(rows, cols), scale[..., 0]


def expand_block_scales(scale: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    """A scale per [rows, columns] block [ceil(N / rows), G] -> one per output row [N, G]."""
    return scale.repeat_interleave(rows, dim=0)[:n].contiguous()


def aligned_block_scales(weight_scale: torch.Tensor, rows: int) -> torch.Tensor | None:
    """The scale per [rows, columns] block back from one per row [N, G] -> [ceil(N / rows), G],
    or None where the layer's blocks do not start every `rows` rows (a fused projection whose
    pieces are not whole blocks)."""
    block_scale = weight_scale[::rows].contiguous()
    expanded = expand_block_scales(block_scale, rows, weight_scale.shape[0])
    return block_scale if torch.equal(expanded, weight_scale) else None


def check_group_layer(qweight: torch.Tensor, weight_scale: torch.Tensor, group: int) -> None:
    """A block-scaled FP8 weight [N, K] with its scales [N, K / group], or a clear error."""
    n, k = qweight.shape
    if qweight.dtype != FP8 or k % group or tuple(weight_scale.shape) != (n, k // group):
        raise ValueError(
            f"qweight {tuple(qweight.shape)} {qweight.dtype}, weight_scale "
            f"{tuple(weight_scale.shape)}: not a block-scaled FP8 layer of groups of {group}"
        )


def quantize_fp8_blockwise_reference(
    w: torch.Tensor,  # [N, K]
    block: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:  # ([N, K] float8_e4m3fn, [N, K / columns] float32)
    """A weight quantized per [rows, columns] block (as block-scaled checkpoints hold it), the
    scales returned in kvflow's layout: one per output row and group of columns."""
    (n, k), (rows, cols) = w.shape, block
    if k % cols:
        raise ValueError(f"{k} columns are not a multiple of the block's {cols}")
    padded = torch.cat([w.float(), w.new_zeros(-n % rows, k, dtype=torch.float32)])
    blocks = padded.reshape(-1, rows, k // cols, cols)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)  # [N / rows, G]
    per_row = expand_block_scales(scale, rows, n)  # [N, G]
    q = (w.float().reshape(n, k // cols, cols) / per_row[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8).reshape(n, k), per_row


def dequantize_fp8_groupwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[R, C] e4m3 with a scale per row and group [R, G] -> [R, C] float32."""
    rows, cols = q.shape
    groups = q.float().reshape(rows, scale.shape[1], -1) * scale.float()[..., None]
    return groups.reshape(rows, cols)


def fp8_group_linear_reference(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N, K / group] float32
    group: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x.dtype
    """x quantized per token and group, times the dequantized weight, in float32."""
    check_group_layer(qweight, weight_scale, group)
    qx, x_scale = quantize_fp8_groupwise_reference(x, group)
    out = (
        dequantize_fp8_groupwise(qx, x_scale) @ dequantize_fp8_groupwise(qweight, weight_scale).t()
    )
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
