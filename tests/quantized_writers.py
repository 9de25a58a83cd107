"""Tiny quantized checkpoints (int4, FP8) in the published on-disk layouts, written
independently of kvflow.

Each writer quantizes a transformers model's projections (round to nearest, per group), packs
them the way the format's own tool does (AutoAWQ's GEMM packer, AutoGPTQ's packer, and for
compressed-tensors that package itself), saves config.json + model.safetensors, and returns
the dequantized float weights the checkpoint stands for, to run the reference model with.
The packing loops follow the formats' definitions word by word on purpose: they share no code
with kvflow's vectorised translation (services/executor/quantization/checkpoints.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "qkv_proj", "gate_up_proj",  # fused (Phi-3): quantized whole, as published
)  # fmt: skip
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Quantized:
    """One projection: integer values q [N, K] in 0..15, zero points [N, G] in 0..15, scales
    [N, G] (float16, as checkpoints store them) and the group of each input column."""

    q: np.ndarray
    zeros: np.ndarray
    scales: torch.Tensor
    g_idx: np.ndarray

    def dequantized(self) -> torch.Tensor:  # [N, K] float32
        groups = torch.from_numpy(self.g_idx).long()
        zeros = torch.from_numpy(self.zeros).float()[:, groups]
        return (torch.from_numpy(self.q).float() - zeros) * self.scales.float()[:, groups]


def quantize(
    weight: torch.Tensor, group_size: int, symmetric: bool, generator: torch.Generator | None
) -> Quantized:
    """Round to nearest per group; with a generator, the columns are first shuffled into
    groups, as GPTQ's act-order does (g_idx then maps each column to its group)."""
    n, k = weight.shape
    order = torch.randperm(k, generator=generator) if generator is not None else torch.arange(k)
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[order.numpy()] = np.arange(k) // group_size
    w = weight.float()[:, order].reshape(n, k // group_size, group_size)
    if symmetric:
        scales = (w.abs().amax(-1) / 7.5).clamp(min=1e-6).half()
        zeros = torch.full(scales.shape, 8.0)
    else:
        low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = ((high - low) / 15).clamp(min=1e-6).half()
        zeros = (-low / scales.float()).round().clamp(0, 15)
    q_grouped = (w / scales.float()[..., None] + zeros[..., None]).round().clamp(0, 15)
    q = np.empty((n, k), dtype=np.int64)
    q[:, order.numpy()] = q_grouped.reshape(n, k).numpy().astype(np.int64)
    return Quantized(q, zeros.numpy().astype(np.int64), scales, g_idx)


def to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(words.astype(np.uint32)).view(np.int32))


def awq_pack_columns(values: np.ndarray) -> np.ndarray:
    """AutoAWQ GEMM: eight columns per word, column 8j + AWQ_ORDER[i] at bits 4i."""
    rows, cols = values.shape
    packed = np.zeros((rows, cols // 8), dtype=np.uint64)
    for j in range(cols // 8):
        for i in range(8):
            packed[:, j] |= values[:, 8 * j + AWQ_ORDER[i]].astype(np.uint64) << np.uint64(4 * i)
    return packed


def gptq_pack(values: np.ndarray, along_rows: bool) -> np.ndarray:
    """AutoGPTQ: eight values per word in natural order, value i at bits 4i; qweight packs
    rows (input columns), qzeros packs columns."""
    v = values if along_rows else values.T
    packed = np.zeros((v.shape[0] // 8, v.shape[1]), dtype=np.uint64)
    for row in range(packed.shape[0]):
        for i in range(8):
            packed[row] |= v[8 * row + i].astype(np.uint64) << np.uint64(4 * i)
    return packed if along_rows else packed.T


def awq_tensors(name: str, layer: Quantized) -> dict[str, torch.Tensor]:
    """A projection as AutoAWQ's GEMM format stores it."""
    return {
        f"{name}.qweight": to_int32(awq_pack_columns(layer.q.T)),  # [K, N/8]
        f"{name}.qzeros": to_int32(awq_pack_columns(layer.zeros.T)),  # [G, N/8]
        f"{name}.scales": layer.scales.t().contiguous(),  # [G, N]
    }


def gptq_tensors(name: str, layer: Quantized) -> dict[str, torch.Tensor]:
    """A projection as AutoGPTQ stores it."""
    # The original GPTQ format stores each zero point minus one (wrapping in 4 bits).
    stored = (layer.zeros.T - 1) & 0xF  # [G, N]
    return {
        f"{name}.qweight": to_int32(gptq_pack(layer.q.T, along_rows=True)),  # [K/8, N]
        f"{name}.qzeros": to_int32(gptq_pack(stored, along_rows=False)),  # [G, N/8]
        f"{name}.scales": layer.scales.t().contiguous(),  # [G, N]
        f"{name}.g_idx": torch.from_numpy(layer.g_idx),  # [K]
    }


def compressed_tensors_tensors(
    name: str, layer: Quantized, symmetric: bool
) -> dict[str, torch.Tensor]:
    """A projection as compressed-tensors' pack-quantized format stores it (its own packer)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    signed = torch.from_numpy(layer.q - 8).to(torch.int8)  # compressed-tensors' convention
    tensors = {
        f"{name}.weight_packed": pack_to_int32(signed, 4),
        f"{name}.weight_scale": layer.scales.contiguous(),  # [N, G]
        f"{name}.weight_shape": torch.tensor(layer.q.shape),
    }
    if not symmetric:
        zero = torch.from_numpy(layer.zeros - 8).to(torch.int8)
        tensors[f"{name}.weight_zero_point"] = pack_to_int32(zero, 4, packed_dim=0)
    return tensors


def _quantize_model(
    model: torch.nn.Module, group_size: int, symmetric: bool, act_order: bool
) -> dict[str, Quantized]:
    out = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            # Projections that read the same input share GPTQ's act-order (it follows the
            # input's statistics), so their column order comes from one seed.
            shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
            seed = sum(shared.replace("up_proj", "gate_proj").encode())
            generator = torch.Generator().manual_seed(seed) if act_order else None
            out[name] = quantize(module.weight.data, group_size, symmetric, generator)
    return out


def _save(
    model: torch.nn.Module,
    folder: Path,
    layers: dict[str, Quantized] | dict[str, Quantized | None],
    tensors: dict[str, torch.Tensor],
    quant_config: dict[str, object],
) -> None:
    """Write the checkpoint, then give `model` the dequantized weights it stands for."""
    for name, param in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if module not in layers or name.endswith(".bias"):
            tensors.setdefault(name, param.detach().clone().contiguous())
    model.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    modules = dict(model.named_modules())
    for name, layer in layers.items():
        if layer is not None:
            modules[name].weight.data = layer.dequantized()


def write_awq(model: torch.nn.Module, folder: Path, group_size: int) -> None:
    layers = _quantize_model(model, group_size, symmetric=False, act_order=False)
    tensors = {}
    for name, layer in layers.items():
        tensors.update(awq_tensors(name, layer))
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True}
    _save(model, folder, layers, tensors, {**config, "version": "gemm"})


def write_gptq(
    model: torch.nn.Module, folder: Path, group_size: int, symmetric: bool, act_order: bool
) -> None:
    layers = _quantize_model(model, group_size, symmetric, act_order)
    tensors = {}
    for name, layer in layers.items():
        tensors.update(gptq_tensors(name, layer))
    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": act_order,
        "sym": symmetric,
        "checkpoint_format": "gptq",
    }
    _save(model, folder, layers, tensors, config)


def write_compressed_tensors(
    model: torch.nn.Module, folder: Path, group_size: int | None, symmetric: bool
) -> None:
    """pack-quantized W4A16 through compressed-tensors' own packer and config classes;
    `group_size` None: one group per output channel (strategy "channel")."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
    )

    channel = group_size is None
    layers = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            size = module.weight.shape[1] if channel else group_size
            layers[name] = quantize(module.weight.data, size, symmetric, None)
    tensors = {}
    for name, layer in layers.items():
        tensors.update(compressed_tensors_tensors(name, layer, symmetric))
    weights = QuantizationArgs(
        num_bits=4,
        type="int",
        symmetric=symmetric,
        strategy="channel" if channel else "group",
        group_size=None if channel else group_size,
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    _save(model, folder, layers, tensors, _compressed_tensors_config(scheme, "pack-quantized"))


def write_fp8(model: torch.nn.Module, folder: Path, per_tensor: bool) -> None:
    """FP8 weights with dynamic per-token activations: per output channel through
    compressed-tensors' own quantize op and FP8_DYNAMIC scheme (what llm-compressor writes),
    or one scale per tensor under transformers' `quant_method: fp8` (as AutoFP8 writes it)."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.quant_scheme import FP8_DYNAMIC

    tensors: dict[str, torch.Tensor] = {}
    dequantized = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        w = module.weight.data.float()
        if per_tensor:
            scale = w.abs().amax() / 448.0  # []
            q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        else:
            scale = w.abs().amax(dim=1, keepdim=True) / 448.0  # [N, 1]
            args = FP8_DYNAMIC["weights"]
            q = ct_quantize(w, scale, torch.zeros_like(scale), args, dtype=torch.float8_e4m3fn)
        tensors[f"{name}.weight"] = q.contiguous()
        tensors[f"{name}.weight_scale"] = scale.contiguous()
        dequantized[name] = q.float() * scale
    if per_tensor:
        config: dict[str, object] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    else:
        scheme = QuantizationScheme(targets=["Linear"], **FP8_DYNAMIC)
        config = _compressed_tensors_config(scheme, "float-quantized")
    layers: dict[str, Quantized | None] = dict.fromkeys(dequantized)
    _save(model, folder, layers, tensors, config)
    modules = dict(model.named_modules())
    for name, weight in dequantized.items():
        modules[name].weight.data = weight


def write_fp8_static(
    model: torch.nn.Module, folder: Path, prompts: list[list[int]], compressed: bool
) -> dict[str, torch.Tensor]:
    """FP8 weights and static activation scales, one per tensor, calibrated on `prompts` as
    AutoFP8 and llm-compressor do (the largest input each projection saw, over 448): under
    compressed-tensors' FP8 scheme, or transformers' `quant_method: fp8` with
    `activation_scheme: static`. Returns each projection's input scale."""
    seen: dict[str, torch.Tensor] = {}

    def observe(name: str):  # type: ignore[no-untyped-def]
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor]) -> None:
            amax = args[0].detach().abs().amax().float()
            seen[name] = torch.maximum(seen.get(name, amax), amax)

        return hook

    projections = [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS]
    handles = [m.register_forward_pre_hook(observe(n)) for n, m in projections]
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    for handle in handles:
        handle.remove()
    tensors: dict[str, torch.Tensor] = {}
    input_scales = {}
    for name, module in projections:
        w = module.weight.data.float()
        scale = w.abs().amax() / 448.0
        q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        input_scales[name] = seen[name] / 448.0
        shape = (1,) if compressed else ()  # as each tool stores a scalar
        tensors[f"{name}.weight"] = q.contiguous()
        tensors[f"{name}.weight_scale"] = scale.reshape(shape).contiguous()
        tensors[f"{name}.input_scale"] = input_scales[name].reshape(shape).contiguous()
        module.weight.data = q.float() * scale
    if compressed:
        from compressed_tensors.quantization import QuantizationScheme
        from compressed_tensors.quantization.quant_scheme import FP8

        scheme = QuantizationScheme(targets=["Linear"], **FP8)
        config = _compressed_tensors_config(scheme, "float-quantized")
    else:
        config = {"quant_method": "fp8", "activation_scheme": "static"}
    layers: dict[str, Quantized | None] = dict.fromkeys(name for name, _ in projections)
    _save(model, folder, layers, tensors, config)
    return input_scales


def _compressed_tensors_config(scheme: object, fmt: str) -> dict[str, object]:
    """compressed-tensors' config.json entry: one group of Linear weights, the lm_head kept."""
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        quantization_status="compressed",
        ignore=["lm_head"],
    ).model_dump(mode="json")
    config["quant_method"] = "compressed-tensors"
    return config


def write_fp8_block(
    model: torch.nn.Module, folder: Path, block: tuple[int, int], compressed: bool
) -> None:
    """Block-scaled FP8 weights, a scale per [rows, columns] block: through compressed-tensors'
    own quantize op and its FP8_BLOCK scheme (activations per token and group, dynamic), or
    as transformers' `quant_method: fp8` with `weight_block_size` and `weight_scale_inv`."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.quant_scheme import FP8_BLOCK

    rows, cols = block
    weights = FP8_BLOCK["weights"].model_copy(update={"block_structure": list(block)})
    activations = FP8_BLOCK["input_activations"].model_copy(update={"group_size": cols})
    tensors: dict[str, torch.Tensor] = {}
    dequantized = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        w = module.weight.data.float()  # [N, K]
        n, k = w.shape
        padded = torch.cat([w, w.new_zeros(-n % rows, k)])  # whole blocks of rows
        blocks = padded.reshape(-1, rows, k // cols, cols)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [N / rows, K / cols]
        expanded = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)  # [N, K]
        if compressed:
            q = ct_quantize(w, scale, torch.zeros_like(scale), weights, dtype=torch.float8_e4m3fn)
        else:
            q = (w / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[f"{name}.weight"] = q.contiguous()
        tensors[f"{name}.weight_scale" if compressed else f"{name}.weight_scale_inv"] = scale
        dequantized[name] = q.float() * expanded
    if compressed:
        scheme = QuantizationScheme(
            targets=["Linear"], weights=weights, input_activations=activations
        )
        config = _compressed_tensors_config(scheme, "float-quantized")
    else:
        config = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(block),
        }
    _save(model, folder, dict.fromkeys(dequantized), tensors, config)
    modules = dict(model.named_modules())
    for name, weight in dequantized.items():
        modules[name].weight.data = weight


ExpertWriter = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def write_experts_apart(model: torch.nn.Module, folder: Path, write: ExpertWriter) -> None:
    """The checkpoint's experts (a dense writer saves them fused, as transformers holds them)
    as quantized mixtures of experts publish them: each expert's gate, up and down apart,
    under `model.layers.L.mlp.experts.E.{gate,up,down}_proj`, stored as `write(prefix,
    weight)` says: (its tensors, the weight they stand for). The model gets those weights."""
    path = folder / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if ".experts." not in k}
    for index, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        for fused, names in (
            (experts.gate_up_proj, ("gate_proj", "up_proj")),
            (experts.down_proj, ("down_proj",)),
        ):
            stood_for = []
            for expert in range(experts.num_experts):
                pieces = fused.data[expert].split(fused.shape[1] // len(names))
                parts = []
                for proj, weight in zip(names, pieces, strict=True):
                    stored, weight_now = write(f"model.layers.{index}.mlp.experts.{expert}.{proj}",
                                               weight)  # fmt: skip
                    tensors.update(stored)
                    parts.append(weight_now)
                stood_for.append(torch.cat(parts))
            fused.data = torch.stack(stood_for).to(fused.dtype)
    save_file(tensors, str(path))


E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., rows, K] -> MXFP4 blocks [..., rows, K/32, 16] and scales [..., rows, K/32], as
    gpt-oss's checkpoints store them (OCP MX: a power-of-two scale a group of 32, its largest
    value at most 6 after scaling; the nearest e2m1 value; two a byte, the even one low), and
    the weight they stand for."""
    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = E2M1_MAGNITUDES.to(weight.device)
    # The nearest magnitude, a tie to the lower: past midpoint i, index i + 1 (0..7)
    index = torch.bucketize(scaled.abs(), (magnitudes[1:] + magnitudes[:-1]) / 2)
    codes = index + 8 * (scaled < 0).long()
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    values = magnitudes[index] * torch.where(scaled < 0, -1.0, 1.0)
    stood_for = (values * torch.exp2(exponent)[..., None]).reshape(weight.shape)
    return blocks, (exponent + 127).to(torch.uint8), stood_for


def write_mxfp4_gpt_oss(model: torch.nn.Module, folder: Path) -> None:
    """A gpt-oss model as its published checkpoints are: every layer's experts in MXFP4
    (`gate_up_proj_blocks` and `_scales` [E, 2 I, H / 32, ...], as [E, out, in]), the rest
    float; the model gets the experts' weights they stand for."""
    model.save_pretrained(folder)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for index, layer in enumerate(model.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(layer.mlp.experts, name)  # [E, in, out]
            blocks, scales, stood_for = mxfp4(param.data.transpose(1, 2))
            prefix = f"model.layers.{index}.mlp.experts.{name}"
            del tensors[prefix]
            tensors[f"{prefix}_blocks"], tensors[f"{prefix}_scales"] = blocks, scales
            param.data = stood_for.transpose(1, 2).contiguous().to(param.dtype)
    save_file(tensors, str(path))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
