"""The building blocks of a decoder layer, calling kernels through `kernels.ops`."""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from services.executor.layers.linear import Activation, Linear
from services.executor.parallel.tensor_parallel import ONE_RANK, TensorParallel


def feeds_fp8_rows(layer: Linear) -> bool:
    """Whether the op feeding this layer quantizes its output for it (`Fp8Rows`): not for a
    layer with LoRA slots, whose adapters multiply the float input."""
    return layer.method.takes_fp8_rows and layer.lora is None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        feeds: Linear | None = None,  # the layer it feeds: an FP8 one takes quantized rows
        reduce: TensorParallel = ONE_RANK,  # x is a rank's part of the sum over this group
    ) -> Activation | tuple[Activation, torch.Tensor]:
        if residual is None:
            return self._norm(reduce.all_reduce(x), feeds)
        w, eps = self.weight, self.eps
        fp8_layer = _fp8_layer(feeds)
        if reduce.size > 1 and fp8_layer is None:
            return reduce.all_reduce_add_rms_norm(x, residual, w, eps)
        x = reduce.all_reduce(x)
        if fp8_layer is None:
            return ops.fused_add_rms_norm(x, residual, w, eps)
        scale = fp8_layer.fp8_input_scale()  # the layer's static scale, or None: per token
        return ops.fused_add_rms_norm_fp8(x, residual, w, eps, scale)

    def begin(
        self, x: torch.Tensor, feeds: Linear | None = None, reduce: TensorParallel = ONE_RANK
    ) -> tuple[Activation, torch.Tensor]:
        """The first norm of the residual stream: (the norm of x, x), with x the embedding
        (with `reduce`, x is a rank's part of it, and the residual stream is the sum)."""
        if reduce.size > 1 and _fp8_layer(feeds) is None:
            return reduce.all_reduce_add_rms_norm(x, None, self.weight, self.eps)
        x = reduce.all_reduce(x)
        return self._norm(x, feeds), x

    def after(
        self, x_norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor, reduce: TensorParallel
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of residual + x_norm(x), that sum): Gemma's norm after a sublayer and the
        next one's before it, in one kernel (with `reduce`, x is a rank's part of its sum)."""
        if x_norm.eps != self.eps:
            raise ValueError(f"norms of eps {x_norm.eps} and {self.eps} cannot run as one")
        x = reduce.all_reduce(x)
        return ops.fused_norm_add_rms_norm(x, residual, x_norm.weight, self.weight, self.eps)

    def _norm(self, x: torch.Tensor, feeds: Linear | None) -> Activation:
        fp8_layer = _fp8_layer(feeds)
        if fp8_layer is None:
            return ops.rms_norm(x, self.weight, self.eps)
        scale = fp8_layer.fp8_input_scale()  # the layer's static scale, or None: per token
        return ops.rms_norm_fp8(x, self.weight, self.eps, scale)


def _fp8_layer(feeds: Linear | None) -> Linear | None:
    """The layer fed, if it takes its input quantized to FP8 rows."""
    return feeds if feeds is not None and feeds_fp8_rows(feeds) else None
