"""`--batch-invariant`: what it covers, checked once the model is loaded, so that the flag is
never accepted where a step of several rows would still compute a row its own way."""

from __future__ import annotations

import torch
from torch import nn

from kernels.invariance import INVARIANT_MAX_ROWS, set_batch_invariant
from services.executor.layers.linear import Linear, Unquantized
from services.executor.layers.moe import SparseMoE
from shared.config import Config
from shared.model_config import ModelConfig

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The decode kernel pads a request's (query, head) pairs to GROUP * INVARIANT_MAX_ROWS rows
# when invariant; past 128 its tiles would no longer fit a program's registers.
MAX_PADDED_PAIRS = 128


def apply_batch_invariant(
    config: Config, model: nn.Module, model_config: ModelConfig, dtype: torch.dtype, tp_size: int
) -> None:
    """Turn the invariant kernels on (or off) for this process; with the flag, raise a
    ValueError naming what it does not cover yet."""
    set_batch_invariant(False)
    if not config.batch_invariant:
        return
    if reason := _uncovered(config, model, model_config, dtype, tp_size):
        raise ValueError(f"--batch-invariant covers {reason}")
    set_batch_invariant(True)


def _uncovered(
    config: Config, model: nn.Module, model_config: ModelConfig, dtype: torch.dtype, tp_size: int
) -> str | None:
    group = model_config.num_heads // model_config.num_kv_heads
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    checks = (
        (dtype in FLOAT_DTYPES, f"float weights, not {dtype}"),
        (tp_size == 1, "--tensor-parallel-size 1 only"),
        (not config.enable_lora, "no LoRA adapters yet"),
        (config.kv_cache_dtype == "auto", "the model's dtype in the KV cache, not fp8"),
        (not model_config.sliding_layers, "full attention only, not sliding windows"),
        (group * INVARIANT_MAX_ROWS <= MAX_PADDED_PAIRS, "at most 8 query heads a KV head"),
        (not any(isinstance(m, SparseMoE) for m in model.modules()), "dense models only"),
        (all(m.method.name == Unquantized.name for m in linears), "unquantized layers only"),
    )
    return next((reason for ok, reason in checks if not ok), None)
