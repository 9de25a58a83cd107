"""Loading a model: built with its linear method, filled from its source (a safetensors folder,
read whole or as slices, its quantized modules translated; a GGUF file; random dummy weights for
benchmarks) by the walk of services/executor/loading/weights.py, then prepared."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator

import torch

from services.executor.layers.linear import Linear
from services.executor.layers.moe import SparseMoE
from services.executor.layers.norm import RMSNorm
from services.executor.loading.fused import unfused
from services.executor.loading.gguf import iter_gguf
from services.executor.loading.safetensors import (
    iter_safetensor_slices,
    iter_safetensors,
    safetensors_names,
)
from services.executor.loading.weights import load_weights
from services.executor.models.decoder import DecoderForCausalLM, hf_module_names
from services.executor.models.eagle3 import Eagle3Head, read_eagle3_config, uses_own_embedding
from services.executor.parallel.shards import CheckpointTensor
from services.executor.parallel.tensor_parallel import ONE_RANK, TensorParallel
from services.executor.quantization.checkpoints import translate_quantized
from services.executor.quantization.methods import linear_method, prepare_linear_layers
from services.executor.quantization.mxfp4 import dequantized_mxfp4
from shared.model_config import ModelConfig, ModelSource
from shared.quant_config import MXFP4, QuantSpec, is_mxfp4_checkpoint, read_quant_spec

logger = logging.getLogger(__name__)


def refuse_ignored_projections(model: DecoderForCausalLM, spec: QuantSpec | None) -> None:
    """A checkpoint whose ignore list leaves some of kvflow's quantized projections in float
    is refused before loading: every projection but the lm_head runs one method. So is MXFP4
    for a model without experts, where it would quantize nothing."""
    if spec is None:
        return
    if spec.method == MXFP4 and not any(isinstance(m, SparseMoE) for m in model.modules()):
        raise ValueError(
            f"MXFP4 (--quantization {MXFP4}, or a checkpoint's quant_method) is for gpt-oss's "
            f"experts; {model.config.family} has none"
        )
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name == "lm_head":
            continue
        for hf_name in hf_module_names(name):
            if spec.ignores(f"model.{hf_name}"):
                raise ValueError(
                    f"the checkpoint leaves model.{hf_name} unquantized (its ignore list); "
                    "kvflow quantizes every projection but the lm_head"
                )


def _quantized_label(spec: QuantSpec | None) -> str:
    """What the load log says of the quantization: MXFP4 is the experts', the rest float."""
    if spec is None:
        return ""
    return ", mxfp4 experts" if spec.method == MXFP4 else f", {spec.label} linear layers"


def init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights with realistic scale (norms at 1), for benchmarks and tests; each
    projection's method fills its own parameters (packed int4 has its own ranges); integer
    tables (an EAGLE-3 head's d2t) keep their zeros.

    Drawn on the parameters' device: an 8B model's worth of randn on the host takes minutes.
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    linear_params: set[int] = set()  # and experts': filled by their own
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.init_dummy(module, generator)
            linear_params.update(id(p) for p in module.parameters())
        elif isinstance(module, SparseMoE):
            module.init_dummy(generator)
            linear_params.update(id(p) for p in module.parameters(recurse=False))
    for name, param in model.named_parameters():
        if "norm" in name or name.endswith(("k_scale", "v_scale")):  # KV scales: none
            param.data.fill_(1.0)
        elif id(param) not in linear_params and param.is_floating_point():
            values = torch.randn(param.shape, generator=generator, device=device)
            param.data.copy_(values.mul_(0.02))


def load_model(
    source: ModelSource,
    cfg: ModelConfig,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    seed: int,
    quantization: str | None = None,
    tp: TensorParallel = ONE_RANK,
) -> DecoderForCausalLM:
    """`quantization`: the --quantization flag; the checkpoint's own config decides when set
    (shared/quant_config.py). `tp`: the rank loads its part of every weight."""
    spec = read_quant_spec(quantization, source, load_format, device_type=device.type)
    fp8 = spec is not None and spec.checkpoint_format == "fp8" and spec.fp8_block is None
    if fp8 and device.type == "cuda" and dtype != torch.bfloat16:
        # cuBLASLt's row-wise scaled FP8 GEMM writes bf16 only.
        raise ValueError("FP8 linear layers run with --dtype bfloat16 (or auto) on CUDA")
    start = time.perf_counter()
    # Parameters are made in `dtype`; those that need another (packed ints, FP8 and its
    # float32 scales, the rotary table) name it.
    with torch.device(device), _default_dtype(dtype):
        kv_scales = spec is not None and spec.kv_scales
        model = DecoderForCausalLM(cfg, max_position, linear_method(spec), kv_scales, tp)
    refuse_ignored_projections(model, spec)
    fmt = source.format if load_format == "auto" else load_format
    if fmt == "dummy" or source.format == "preset":
        init_dummy(model, seed)
    elif fmt == "gguf":
        keep_blocks = spec is not None and spec.method == "gguf"
        load_weights(model, _unfused(iter_gguf(source.path, cfg, keep_blocks), cfg))
    elif fmt == "safetensors":
        load_weights(model, _safetensors(source, cfg, spec, tp.size > 1))
    else:
        raise ValueError(f"cannot load {source.path} with --load-format {load_format}")
    prepare_linear_layers(model, spec)
    if cfg.norm_offset:  # Gemma's norms scale by 1 + w: the kernels multiply by the sum
        with torch.no_grad():
            for norm in (m for m in model.modules() if isinstance(m, RMSNorm)):
                norm.weight.add_(1.0)
    for layer in model.layers:
        layer.self_attn.prepare_kv_scales()
    logger.info(
        "loaded %s (%s, %s%s, %.2f GiB of weights, %s) in %.1f s",
        source.name,
        fmt,
        str(dtype).removeprefix("torch."),
        _quantized_label(spec),
        weight_bytes(model) / 2**30,
        device,
        time.perf_counter() - start,
    )
    return model.eval()


def _safetensors(
    source: ModelSource, cfg: ModelConfig, spec: QuantSpec | None, sliced: bool
) -> Iterable[tuple[str, CheckpointTensor]]:
    """A safetensors folder's tensors as its layers load them: quantized ones translated,
    MXFP4 experts dequantized, fused projections cut (`sliced`: read as a rank's parts)."""
    if spec is not None and spec.method == MXFP4:  # gpt-oss's experts kept MXFP4
        tensors = iter_safetensor_slices(source.path)
    elif spec is not None and spec.from_checkpoint:
        names = safetensors_names(source.path)
        tensors = translate_quantized(iter_safetensor_slices(source.path), names, spec)
    elif is_mxfp4_checkpoint(source):  # gpt-oss's experts, for float or FP8 ones
        tensors = dequantized_mxfp4(iter_safetensor_slices(source.path))
    elif sliced:
        tensors = iter_safetensor_slices(source.path)
    else:
        tensors = iter_safetensors(source.path)
    return _unfused(tensors, cfg)


def _unfused(
    tensors: Iterable[tuple[str, CheckpointTensor]], cfg: ModelConfig
) -> Iterable[tuple[str, CheckpointTensor]]:
    """Fused projections (Phi-3's) cut into the pieces the layers load."""
    return unfused(tensors, cfg) if cfg.family == "phi3" else tensors


def eagle3_head_has_embedding(source: ModelSource, load_format: str) -> bool:
    """Whether the head's checkpoint has an embedding of its own (else it reads the
    target's); dummy heads have none."""
    dummy = load_format == "dummy" or source.format == "preset"
    return not dummy and uses_own_embedding(safetensors_names(source.path))


def load_eagle3_head(
    source: ModelSource,
    target: DecoderForCausalLM,
    load_format: str,
    dtype: torch.dtype,
    max_position: int,
    seed: int,
    target_embedding: torch.nn.Module | None = None,
) -> Eagle3Head:
    """An EAGLE-3 head for `target` (on its device), from its folder (dummy weights with
    --load-format dummy or a preset). `target_embedding`: the target's embedding whole, where
    the target holds a rank's rows of it (default: the target's own)."""
    cfg = read_eagle3_config(source, target.config)
    dummy = load_format == "dummy" or source.format == "preset"
    own_embedding = eagle3_head_has_embedding(source, load_format)
    device = target.embed_tokens.weight.device
    embedding = target_embedding if target_embedding is not None else target.embed_tokens
    with torch.device(device), _default_dtype(dtype):
        head = Eagle3Head(cfg, max_position, own_embedding, embedding)
    if dummy:
        init_dummy(head, seed)
    else:
        load_weights(head, iter_safetensors(source.path))
    prepare_linear_layers(head, None)
    logger.info(
        "loaded EAGLE-3 head %s (%s, reads target layers %s, %d draft tokens, %.2f GiB)",
        source.name,
        "dummy" if dummy else "safetensors",
        list(cfg.aux_layer_ids),
        cfg.draft_vocab_size,
        weight_bytes(head) / 2**30,
    )
    return head.eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def weight_bytes(model: torch.nn.Module) -> int:
    """What the weights hold in memory: parameters, and the quantized weights and scales."""
    tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if "weight" in n)]
    return sum(t.numel() * t.element_size() for t in tensors)
