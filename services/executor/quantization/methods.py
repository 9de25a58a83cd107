"""Which linear method a model's projections run: chosen once at load, from the checkpoint's
config or --quantization."""

from __future__ import annotations

import logging

from torch import nn

from services.executor.layers.linear import Linear, LinearMethod, Unquantized
from services.executor.layers.moe import ExpertsMethod, FloatExperts, SparseMoE
from services.executor.quantization.fp8 import (
    Fp8Block,
    Fp8Checkpoint,
    Fp8Dynamic,
    Fp8Experts,
    Fp8Static,
)
from services.executor.quantization.gguf import GgufBlocks
from services.executor.quantization.int4 import Int4Experts, Int4WeightOnly
from services.executor.quantization.mxfp4 import Mxfp4Checkpoint, Mxfp4Experts
from shared.quant_config import MXFP4, QuantSpec

logger = logging.getLogger(__name__)


def linear_method(spec: QuantSpec | None) -> LinearMethod:
    """The method every projection but the lm_head runs (the lm_head keeps its float weight,
    as vLLM keeps it: it is tied to the embedding in many models, and quantizing it moves
    logits more than any other layer)."""
    if spec is None:
        return Unquantized()
    if spec.fp8_block is not None:
        return Fp8Block(spec.fp8_block)
    if spec.checkpoint_format == "fp8" and spec.static_input:
        return Fp8Static()
    if spec.checkpoint_format == "fp8":
        return Fp8Checkpoint() if spec.from_checkpoint else Fp8Dynamic()
    if spec.method == "gguf":
        return GgufBlocks()
    if spec.method == MXFP4:
        return Mxfp4Checkpoint()
    return Int4WeightOnly(spec)


def experts_method(method: LinearMethod | None) -> ExpertsMethod:
    """How a mixture of experts' experts are stored under the model's linear method: float,
    FP8 (as the checkpoint holds them, or quantized at load), int4 or MXFP4; what they cannot
    run is refused by name."""
    if method is None or type(method) is Unquantized:
        return FloatExperts()
    if isinstance(method, Mxfp4Checkpoint):
        return Mxfp4Experts()
    if isinstance(method, Fp8Block):
        return Fp8Experts(from_checkpoint=True, group=method.group)
    if isinstance(method, Fp8Static):
        raise ValueError("FP8 experts with static activation scales are not supported yet")
    if isinstance(method, Fp8Checkpoint):
        return Fp8Experts(from_checkpoint=True)
    if isinstance(method, Fp8Dynamic):
        return Fp8Experts(from_checkpoint=False)
    if isinstance(method, Int4WeightOnly):
        return Int4Experts(method.spec)
    raise ValueError(
        f"{method.name} experts are not supported yet (float, FP8, int4 and MXFP4 are)"
    )


def prepare_linear_layers(model: nn.Module, spec: QuantSpec | None) -> None:
    """After loading: let each layer's method prepare its weights (e.g. quantize them)."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    for _, layer in layers:
        layer.method.prepare(layer)
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.prepare()
    if spec is not None and spec.method == MXFP4:
        moes = sum(isinstance(module, SparseMoE) for module in model.modules())
        logger.info("quantization: mxfp4 experts in %d layers, linear layers float", moes)
    elif spec is not None:
        quantized = sum(1 for name, _ in layers if name != "lm_head")
        logger.info("quantization: %s on %d linear layers (lm_head kept)", spec.label, quantized)
