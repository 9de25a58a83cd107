"""The quantized linear layers' kernel entry points (FP8, int4, GGUF): Triton and cuBLASLt on
CUDA tensors, torch references elsewhere, as kernels/ops.py's.
"""

from __future__ import annotations

import torch

from kernels.fp8 import Fp8Rows, fp8_group_linear_reference, fp8_linear_reference
from kernels.gguf import gguf_linear_reference
from kernels.int4 import int4_linear_reference
from kernels.ops import triton_module

# Block-scaled FP8 goes to cuBLASLt's blockwise GEMM past this many rows, where it has one.
FP8_BLOCK_TRITON_MAX_ROWS = 16
# FP8 weights stream faster through the FP8 GEMV than through cuBLASLt's scaled GEMM up to its
# 64 rows (sweeps/fp8_sweep.py --quantized-rows, H100, Llama-3.1-8B layers, 2026-11-28:
# 91.4 against 123.6 us a layer's four projections at M = 32, 97.7 against 117.0 at M = 64).
FP8_SKINNY_MAX_ROWS = 64


def fp8_linear(
    x: torch.Tensor | Fp8Rows,  # [M, K], or quantized per token by the op that produced it
    qweight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
    input_scale: torch.Tensor | None = None,  # [1]: x's static scale (else one per token)
) -> torch.Tensor:  # [M, N], x's float dtype
    """An FP8 W8A8 linear layer: on CUDA the activation quantized per token (or by its static
    scale) in Triton, unless its producer did; then up to FP8_SKINNY_MAX_ROWS rows the Triton
    FP8 GEMV, past that cuBLASLt's row-wise scaled FP8 GEMM (`torch._scaled_mm`); elsewhere
    the reference."""
    if isinstance(x, Fp8Rows) and input_scale is not None:
        raise ValueError("x is quantized already: its producer chose the scales")
    module = triton_module("fp8", x.q if isinstance(x, Fp8Rows) else x)
    if module is None:
        return fp8_linear_reference(x, qweight, weight_scale, bias, input_scale)
    if isinstance(x, Fp8Rows):
        rows = x
    else:
        rows = Fp8Rows(*module.quantize_fp8_rowwise(x, input_scale), x.dtype)
    m = rows.q.shape[0]
    if m == 0:
        return torch.empty((0, qweight.shape[0]), dtype=rows.dtype, device=rows.q.device)
    if m <= FP8_SKINNY_MAX_ROWS:  # decode: the weight streamed by the FP8 GEMV
        return module.fp8_skinny_linear(rows, qweight, weight_scale, bias)
    if rows.dtype != torch.bfloat16:
        raise ValueError(
            f"cuBLASLt's row-wise scaled FP8 GEMM returns bfloat16 only, not {rows.dtype}: "
            "FP8 layers run in bfloat16 on CUDA"
        )
    # Why .t() of the [N, K] weight: cuBLASLt takes the second operand column-major.
    return torch._scaled_mm(
        rows.q,
        qweight.t(),
        scale_a=rows.scale,
        scale_b=weight_scale[None, :],
        bias=bias,
        out_dtype=rows.dtype,
    )


def blockwise_scaled_mm_supported(device: torch.device, k: int) -> bool:
    """Whether cuBLASLt's blockwise-scaled FP8 GEMM takes a 128 x 128-block layer of K inputs
    here: Hopper (torch implements the recipe for SM90 only), CUDA 12.9 or newer, and K / 128 a
    multiple of 4 (its scales' leading dimension must be 16-byte aligned)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    cuda = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    return cuda >= (12, 9) and k % 128 == 0 and (k // 128) % 4 == 0


def fp8_group_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N, K / group] float32
    group: int,
    bias: torch.Tensor | None = None,  # [N]
    block_scale: torch.Tensor | None = None,  # [ceil(N / 128), K / 128]: 128 x 128 blocks
) -> torch.Tensor:  # [M, N], x.dtype
    """A block-scaled FP8 W8A8 layer (`kernels/fp8.py`): on CUDA the activation quantized per
    token and group, then one Triton kernel; past FP8_BLOCK_TRITON_MAX_ROWS rows of bf16,
    cuBLASLt's blockwise-scaled FP8 GEMM instead where the layer has `block_scale`
    (Fp8Block.prepare makes one only where cuBLASLt takes the layer); elsewhere the reference."""
    module = triton_module("fp8", x)
    if module is None:
        return fp8_group_linear_reference(x, qweight, weight_scale, group, bias)
    small = x.shape[0] <= FP8_BLOCK_TRITON_MAX_ROWS
    if small or block_scale is None or x.dtype != torch.bfloat16:
        return module.fp8_group_linear(x, qweight, weight_scale, group, bias)
    m = x.shape[0]
    # cuBLASLt's layouts: the activation scales column-major, with a leading dimension (M) a
    # multiple of 4 (so rows are padded to one); the weight's [K / 128, N / 128].
    padded = x if m % 4 == 0 else torch.nn.functional.pad(x, (0, 0, 0, -m % 4))
    qx, x_scale = module.quantize_fp8_groupwise(padded, group)
    out = torch._scaled_mm(
        qx,
        qweight.t(),
        scale_a=x_scale.t().contiguous().t(),
        scale_b=block_scale.t(),
        out_dtype=x.dtype,
    )[:m]
    return out if bias is None else out + bias


def int4_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K/8] int32
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None,  # [N, G] uint8; None: 8
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x.dtype
    """An int4 weight-only linear layer (`kernels/int4.py`): on CUDA Triton kernels that
    dequantize in registers up to 64 rows, and past that the weight dequantized for cuBLAS
    (`kernels/triton_int4.py`); elsewhere the reference."""
    module = triton_module("int4", x)
    kernel = module.int4_linear if module is not None else int4_linear_reference
    return kernel(x, qweight, scales, zeros, group_size, g_idx, bias)


def gguf_linear(
    x: torch.Tensor,  # [M, K]
    raw: torch.Tensor,  # [N, row_bytes] uint8: the GGUF file's blocks
    qtype: str,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x.dtype
    """A GGUF-quantized linear layer (`kernels/gguf.py`): on CUDA Triton kernels that
    dequantize the blocks where they read them; elsewhere the reference."""
    module = triton_module("gguf", x)
    kernel = module.gguf_linear if module is not None else gguf_linear_reference
    return kernel(x, raw, qtype, bias)
