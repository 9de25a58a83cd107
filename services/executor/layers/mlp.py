"""The gated MLP of a decoder layer: gate_up_proj, SiLU-and-multiply (or GELU-and-multiply,
Gemma's GeGLU), down_proj."""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from services.executor.layers.linear import Activation, Linear, LinearMethod
from services.executor.layers.lora import LoraTokens
from services.executor.layers.norm import feeds_fp8_rows
from services.executor.parallel.layout import ShardLayout


class GatedMLP(nn.Module):
    def __init__(
        self, layout: ShardLayout, method: LinearMethod | None = None, columns: int | None = None
    ) -> None:
        """`layout`: what this rank holds (its MLP columns; all of them on one rank);
        `columns`: this rank's width, if not the model's intermediate size (a shared expert)."""
        super().__init__()
        self.gelu = gelu = layout.local_config.hidden_act == "gelu_tanh"
        self.act = ops.gelu_tanh_and_mul if gelu else ops.silu_and_mul
        self.act_fp8 = ops.gelu_tanh_and_mul_fp8 if gelu else ops.silu_and_mul_fp8
        hidden = layout.local_config.hidden_size
        columns = columns or layout.local_config.intermediate_size
        # gate and up split by output rows, down by input columns
        gate_up = layout.column_parallel(columns, columns)
        self.gate_up_proj = Linear(hidden, 2 * columns, method=method, sharding=gate_up)
        down = layout.row_parallel(hidden)
        self.down_proj = Linear(columns, hidden, method=method, sharding=down)

    def forward(self, x: Activation, lora: LoraTokens | None = None) -> torch.Tensor:
        """`lora`: the tokens' LoRA slots (see Linear.forward), or None."""
        gate_up = self.gate_up_proj(x, lora)  # [T, 2 * intermediate]
        down = self.down_proj
        if feeds_fp8_rows(down):  # quantized as down_proj would (its static scale)
            return down(self.act_fp8(gate_up, down.fp8_input_scale()), lora)
        out = None
        if lora is None or down.lora is None:  # the weight's kernel may make its own input
            out = down.method.apply_gated(down, gate_up, self.gelu)
        if out is None:
            out = down(self.act(gate_up), lora)  # [T, hidden]
        return out  # this rank's part: the next RMSNorm sums the ranks' (its `reduce`)
