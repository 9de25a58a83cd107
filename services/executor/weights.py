"""Weight sources, each yielding (Hugging Face name, tensor): safetensors folders, GGUF files,
and random dummy weights for benchmarks."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import EllipsisType
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

from kernels.gguf import GGUF_TYPES
from services.executor.linear import Linear, PackedWeight, linear_method, prepare_linear_layers
from services.executor.linear_shards import CheckpointSlice
from services.executor.models.decoder import DecoderForCausalLM, hf_module_names
from services.executor.quantized_checkpoints import translate_quantized
from services.executor.tensor_parallel import ONE_RANK, TensorParallel
from shared.model_config import ModelConfig, ModelSource
from shared.quant_config import QuantSpec, read_quant_spec

logger = logging.getLogger(__name__)

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [folder / f for f in files]
    else:
        paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    return paths


def safetensors_names(folder: Path) -> set[str]:
    """Every tensor name of the checkpoint, from the files' headers (no tensor is read)."""
    names: set[str] = set()
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def _open_tensors(folder: Path) -> Iterator[tuple[Any, str]]:
    """(open file, tensor name) of every tensor of the checkpoint, file by file; every file
    stays open to the end, for slices read later (a quantized module's parts may sit in
    several files)."""
    with contextlib.ExitStack() as files:
        for path in safetensors_files(folder):
            f = files.enter_context(safe_open(str(path), framework="pt"))
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield f, name


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f, name in _open_tensors(folder):
        yield name, f.get_tensor(name)


def iter_safetensor_slices(folder: Path) -> Iterator[tuple[str, CheckpointSlice]]:
    """The checkpoint's tensors unread: a tensor-parallel rank reads only its part of each."""
    for f, name in _open_tensors(folder):
        yield name, CheckpointSlice(f.get_slice(name))


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (interleaved RoPE pairs) back to rotate-half order."""
    # llama.cpp stores each head's rows as (pairs, 2); the checkpoint had (2, pairs).
    pairs = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, pairs, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def iter_gguf(
    path: Path, cfg: ModelConfig, keep_blocks: bool = False
) -> Iterator[tuple[str, CheckpointSlice | PackedWeight]]:
    """The file's tensors unread (a tensor-parallel rank reads and dequantizes only its part),
    as float32; with `keep_blocks`, the projections' weights as `PackedWeight`s instead:
    their blocks as stored, or float for the types without a kernel (and F16/F32), which are
    counted in a warning."""
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    dequantized: Counter[str] = Counter()
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        qtype = tensor.tensor_type.name
        packed = keep_blocks and name.endswith("_proj.weight")
        blocks = packed and qtype in GGUF_TYPES
        if packed and not blocks and qtype not in ("F32", "F16", "BF16"):
            dequantized[qtype] += 1
        # llama.cpp's q/k row order; a row permutation moves whole rows of blocks as well.
        rope_rows = arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight"))
        part = _GgufPart(tensor.data, tensor.tensor_type, blocks, cfg.head_dim if rope_rows else 0)
        weight = CheckpointSlice(part)
        yield name, (PackedWeight(_packed_type(qtype), weight) if packed else weight)
    if dequantized:
        logger.warning(
            "GGUF types without a kernel, dequantized to float at load (more memory): %s",
            ", ".join(f"{count} {qtype}" for qtype, count in sorted(dequantized.items())),
        )


class _GgufPart:
    """A GGUF tensor in its memory-mapped file, as `CheckpointSlice` reads one: its shape, and
    the part an index takes, read then (blocks as stored, or dequantized to float32). Columns
    are values of a dequantized tensor (the blocks holding them are read) or bytes of a blocks
    one. `rope_head_dim`: llama.cpp's q/k rows, put back in rotate-half order as read (a cut
    takes whole heads, so each head is unpermuted alone)."""

    def __init__(
        self, data: np.ndarray, qtype: gguf.GGMLQuantizationType, blocks: bool, rope_head_dim: int
    ) -> None:
        self.data, self.qtype, self.blocks = data, qtype, blocks
        self.rope_head_dim = rope_head_dim
        # Each stored row is blocks of `elems` values in `width` entries (bytes, or one typed
        # value for F32/F16/BF16).
        elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        self.elems, self.width = (1, 1) if blocks else (elems, nbytes // data.itemsize)

    def get_shape(self) -> list[int]:
        shape = list(self.data.shape)
        shape[-1] = shape[-1] // self.width * self.elems
        return shape

    def __getitem__(self, index: tuple[slice, ...] | EllipsisType) -> torch.Tensor:
        view, columns = self.data, slice(None)
        if isinstance(index, tuple):
            *rows, columns = index if len(index) == view.ndim else (*index, slice(None))
            view = view[tuple(rows)]
        start, stop, _ = columns.indices(self.get_shape()[-1])
        if self.blocks:  # bytes of whole blocks: what a rank cuts is the method's to check
            weight = torch.from_numpy(np.array(view[..., start:stop], dtype=np.uint8))
        else:  # the whole blocks holding the columns, dequantized, then the columns
            first, last = start // self.elems, -(-stop // self.elems)
            stored = np.ascontiguousarray(view[..., first * self.width : last * self.width])
            values = gguf.quants.dequantize(stored, self.qtype)
            offset = first * self.elems
            values = values[..., start - offset : stop - offset]
            weight = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy
        if self.rope_head_dim:
            weight = _unpermute_rope(weight, weight.shape[0] // self.rope_head_dim)
        return weight


def _packed_type(qtype: str) -> str:
    return qtype if qtype in GGUF_TYPES else "float"


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    _, layer, piece, suffix = gguf_name.split(".")
    if piece not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[piece]}.{suffix}"


def refuse_ignored_projections(model: DecoderForCausalLM, spec: QuantSpec | None) -> None:
    """A checkpoint whose ignore list leaves some of kvflow's quantized projections in float
    is refused before loading: every projection but the lm_head runs one method."""
    if spec is None:
        return
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name == "lm_head":
            continue
        for hf_name in hf_module_names(name):
            if spec.ignores(f"model.{hf_name}"):
                raise ValueError(
                    f"the checkpoint leaves model.{hf_name} unquantized (its ignore list); "
                    "kvflow quantizes every projection but the lm_head"
                )


def init_dummy(model: DecoderForCausalLM, seed: int) -> None:
    """Random weights with realistic scale (norms at 1), for benchmarks and tests; each
    projection's method fills its own parameters (packed int4 has its own ranges).

    Drawn on the parameters' device: an 8B model's worth of randn on the host takes minutes.
    """
    device = model.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    linear_params: set[int] = set()
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.init_dummy(module, generator)
            linear_params.update(id(p) for p in module.parameters())
    for name, param in model.named_parameters():
        if "norm" in name or name.endswith(("k_scale", "v_scale")):  # KV scales: none
            param.data.fill_(1.0)
        elif id(param) not in linear_params:
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
        model.load_weights(iter_gguf(source.path, cfg, keep_blocks))
    elif fmt == "safetensors" and spec is not None and spec.from_checkpoint:
        names = safetensors_names(source.path)
        tensors = iter_safetensor_slices(source.path)
        model.load_weights(translate_quantized(tensors, names, spec))
    elif fmt == "safetensors" and tp.size > 1:
        model.load_weights(iter_safetensor_slices(source.path))
    elif fmt == "safetensors":
        model.load_weights(iter_safetensors(source.path))
    else:
        raise ValueError(f"cannot load {source.path} with --load-format {load_format}")
    prepare_linear_layers(model, spec)
    for layer in model.layers:
        layer.self_attn.prepare_kv_scales()
    logger.info(
        "loaded %s (%s, %s%s, %.2f GiB of weights, %s) in %.1f s",
        source.name,
        fmt,
        str(dtype).removeprefix("torch."),
        f", {spec.label} linear layers" if spec else "",
        weight_bytes(model) / 2**30,
        device,
        time.perf_counter() - start,
    )
    return model.eval()


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
