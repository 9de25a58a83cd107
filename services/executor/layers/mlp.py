"""The gated MLP of a decoder layer: gate_up_proj, SiLU-and-multiply, down_proj."""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from services.executor.layers.linear import Activation, Linear, LinearMethod
from services.executor.layers.lora import LoraTokens
from services.executor.layers.norm import feeds_fp8_rows
from services.executor.parallel.tensor_parallel import ONE_RANK, TensorParallel


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,  # this rank's columns (all of them on one rank)
        method: LinearMethod | None = None,
        tp: TensorParallel = ONE_RANK,
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, method=method)
        whole = intermediate_size * tp.size  # down_proj is row-parallel
        self.down_proj = Linear(
            intermediate_size, hidden_size, method=method, whole_in_features=whole
        )

    def forward(self, x: Activation, lora: LoraTokens | None = None) -> torch.Tensor:
        """`lora`: the tokens' LoRA slots (see Linear.forward), or None."""
        gate_up = self.gate_up_proj(x, lora)  # [T, 2 * intermediate]
        if feeds_fp8_rows(self.down_proj):  # quantized as down_proj would (its static scale)
            scale = self.down_proj.fp8_input_scale()
            out = self.down_proj(ops.silu_and_mul_fp8(gate_up, scale), lora)
        else:
            out = self.down_proj(ops.silu_and_mul(gate_up), lora)  # [T, hidden]
        return out  # this rank's part: the next RMSNorm sums the ranks' (its `reduce`)
