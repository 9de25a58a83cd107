"""How a model's linear layers are quantized: `--quantization` and the checkpoint's own
`quantization_config` (config.json), read into one `QuantSpec`.

A checkpoint that says how it is quantized is loaded that way; the flag may name the same
method or be left out (auto), and naming another is an error, as in vLLM. Without a
checkpoint config, `fp8` quantizes float weights at load, and the int4 methods run only on
dummy weights (benchmarks), with the method's usual defaults. Everything kvflow cannot run is
refused at startup with the field that says so.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from shared.model_config import ModelSource

INT4_METHODS = ("awq", "gptq", "compressed-tensors")
MXFP4 = "mxfp4"  # quant_method of gpt-oss's checkpoints: MXFP4 experts, the rest float
METHODS = ("fp8", *INT4_METHODS, "gguf", MXFP4)


@dataclass(frozen=True)
class QuantSpec:
    method: str  # one of METHODS
    from_checkpoint: bool  # the weights on disk are already quantized in the method's layout
    group_size: int = 128  # int4: input columns per scale; -1: one group per output channel
    symmetric: bool = False  # int4: no zero points stored (the zero is 8)
    act_order: bool = False  # int4: a g_idx maps input columns to groups (GPTQ desc_act)
    zeros_minus_one: bool = False  # GPTQ's original format stores each zero point minus one
    ignore: tuple[str, ...] = ()  # module names left unquantized (lm_head is always)
    fp8_weights: bool = False  # a compressed-tensors checkpoint of FP8 (float-quantized) weights
    fp8_block: tuple[int, int] | None = None  # FP8: weight rows and columns per scale (blocks)
    kv_scales: bool = False  # each attention layer has k_scale and v_scale (an FP8 KV cache's)
    static_input: bool = False  # FP8: activations scaled by the checkpoint's input_scale

    @property
    def checkpoint_format(self) -> str:
        """How the quantized tensors are laid out on disk (services/executor/
        quantized_checkpoints.py): fp8, fp8_block (transformers' block scales, named
        weight_scale_inv), or the method's own layout (awq, gptq, compressed-tensors int4;
        gguf, which iter_gguf reads)."""
        if self.method == "fp8":  # transformers' block scales are named weight_scale_inv
            return "fp8" if self.fp8_block is None else "fp8_block"
        return "fp8" if self.fp8_weights else self.method

    @property
    def label(self) -> str:
        """The method as logs name it, with FP8 block scales' shape or static activations."""
        if self.static_input:
            return f"{self.method} (FP8, static activation scales)"
        if self.fp8_block is None:
            return self.method
        return f"{self.method} (FP8, a scale per {self.fp8_block[0]}x{self.fp8_block[1]} block)"

    def ignores(self, module: str) -> bool:
        """Whether `ignore` names this module: "re:" + a regular expression (compressed-
        tensors), or a piece of the name (AWQ's and GPTQ's modules_to_not_convert)."""
        for entry in self.ignore:
            if entry.startswith("re:") and re.fullmatch(entry[3:], module):
                return True
            if not entry.startswith("re:") and entry in module:
                return True
        return False


def read_quant_spec(
    flag: str | None, source: ModelSource, load_format: str, *, device_type: str
) -> QuantSpec | None:
    """The quantization to run, from the flag and the checkpoint; None: float layers.
    `device_type` ("cuda", "cpu") decides only for GGUF files (see `_gguf`)."""
    if source.is_gguf and load_format in ("auto", "gguf"):
        return _gguf(flag, device_type)
    if flag == "gguf":
        raise ValueError(
            "--quantization gguf needs a .gguf model file (and no --load-format dummy)"
        )
    checkpoint = _checkpoint_config(source)
    if checkpoint is not None and checkpoint.get("quant_method") == MXFP4:
        return _mxfp4(flag, device_type)
    if checkpoint is not None:
        spec = _from_checkpoint(checkpoint)
        if flag is not None and flag != spec.method:
            raise ValueError(
                f"--quantization {flag} does not match the checkpoint, which is quantized with "
                f"{spec.method} (config.json quantization_config); leave the flag out"
            )
        return spec
    if flag is None or flag == "fp8":
        return None if flag is None else QuantSpec("fp8", from_checkpoint=False)
    dummy = load_format == "dummy" or source.format == "preset"
    if flag in INT4_METHODS and dummy:
        return QuantSpec(flag, from_checkpoint=False, symmetric=flag != "awq")
    if flag == MXFP4 and dummy:
        return QuantSpec(MXFP4, from_checkpoint=False)
    raise ValueError(
        f"--quantization {flag} needs a checkpoint quantized with {flag} (config.json has no "
        "quantization_config) or --load-format dummy; float weights are quantized at load "
        "only by --quantization fp8"
    )


def _mxfp4(flag: str | None, device_type: str) -> QuantSpec | None:
    """gpt-oss's checkpoints: on CUDA (or by the flag) the experts stay MXFP4, the other
    layers float (services/executor/quantization/mxfp4.py); on the CPU they are dequantized
    at load unless the flag asks otherwise, as a GGUF file's (the CPU would dequantize them
    every step); --quantization fp8 dequantizes them and makes every layer FP8."""
    if flag not in (None, MXFP4, "fp8"):
        raise ValueError(f"--quantization {flag} does not apply to an MXFP4 checkpoint")
    if flag == MXFP4 or (flag is None and device_type == "cuda"):
        return QuantSpec(MXFP4, from_checkpoint=True)
    return None if flag is None else QuantSpec("fp8", from_checkpoint=False)


def _gguf(flag: str | None, device_type: str) -> QuantSpec | None:
    """A GGUF file's weights keep their own types (each tensor's) in memory on CUDA; on the
    CPU they are dequantized to float at load unless --quantization gguf asks otherwise
    (dequantizing every step costs more there than the memory it saves)."""
    if flag == "gguf" or (flag is None and device_type == "cuda"):
        return QuantSpec("gguf", from_checkpoint=True)
    if flag is None or flag == "fp8":
        return None if flag is None else QuantSpec("fp8", from_checkpoint=False)
    raise ValueError(
        f"--quantization {flag} does not apply to a GGUF file, whose tensors carry their own "
        "GGUF types; leave the flag out or pass gguf (or fp8, to requantize its weights)"
    )


def is_mxfp4_checkpoint(source: ModelSource) -> bool:
    """gpt-oss's published checkpoints: MXFP4 experts (`*_blocks`, `*_scales`), the rest float."""
    checkpoint = _checkpoint_config(source)
    return checkpoint is not None and checkpoint.get("quant_method") == MXFP4


def _checkpoint_config(source: ModelSource) -> dict[str, Any] | None:
    if source.format != "safetensors":
        return None
    config = json.loads((source.path / "config.json").read_text())
    quantization: dict[str, Any] | None = config.get("quantization_config")
    return quantization


def _from_checkpoint(cfg: dict[str, Any]) -> QuantSpec:
    method = cfg.get("quant_method")
    if method == "fp8":
        return _fp8(cfg)
    if method == "awq":
        return _awq(cfg)
    if method == "gptq":
        return _gptq(cfg)
    if method == "compressed-tensors":
        kv_scales = _kv_scales(cfg)
        return dataclasses.replace(_compressed_tensors(cfg), kv_scales=kv_scales)
    raise ValueError(
        f"quantization_config.quant_method {method!r} is not supported; kvflow loads "
        f"{', '.join(METHODS)} checkpoints (and quantizes float weights with "
        "--quantization fp8)"
    )


def _kv_scales(cfg: dict[str, Any]) -> bool:
    """compressed-tensors' kv_cache_scheme: a calibrated e4m3 scale per attention layer for
    keys and one for values (k_scale, v_scale), which `--kv-cache-dtype fp8` applies."""
    scheme = cfg.get("kv_cache_scheme")
    if scheme is None:
        return False
    ok = isinstance(scheme, dict)
    ok = ok and f"{scheme.get('type')}{scheme.get('num_bits')}" == "float8"
    ok = ok and scheme.get("strategy") == "tensor" and not scheme.get("dynamic")
    ok = ok and scheme.get("symmetric", True) is True
    _require(ok, "kv_cache_scheme", scheme, "FP8, static, symmetric, one scale per tensor")
    return True


def _require(ok: bool, field: str, value: Any, supported: str) -> None:
    if not ok:
        raise ValueError(f"quantization_config.{field} = {value!r} is not supported ({supported})")


def _group_size(value: Any, field: str) -> int:
    group = -1 if value in (None, -1, 0) else value
    _require(
        isinstance(group, int) and (group == -1 or (group >= 8 and group % 8 == 0)),
        field,
        value,
        "a multiple of 8, or -1 for one group per channel",
    )
    return int(group)


def _fp8(cfg: dict[str, Any]) -> QuantSpec:
    """FP8 checkpoints as transformers and AutoFP8 write them: e4m3 weights with a scale per
    tensor, or per [rows, columns] block (`weight_block_size`, as DeepSeek-V3 and Qwen3's FP8
    releases), activations quantized at run time (activation_scheme dynamic): per token, and
    per group of the block's columns with block scales; or, with scales per tensor, by the
    calibrated scale each layer's input_scale holds (activation_scheme static, as AutoFP8
    writes it)."""
    scheme = cfg.get("activation_scheme", "dynamic")
    _require(scheme in ("dynamic", "static"), "activation_scheme", scheme, "dynamic, static")
    fmt = cfg.get("fmt", "e4m3")
    _require(fmt == "e4m3", "fmt", fmt, "e4m3")
    block = _fp8_block(cfg.get("weight_block_size"), "weight_block_size")
    static = scheme == "static"
    _require(not (static and block), "activation_scheme", scheme, "dynamic with block scales")
    return QuantSpec(
        "fp8", from_checkpoint=True, ignore=_ignored(cfg), fp8_block=block, static_input=static
    )


def _fp8_block(value: Any, field: str) -> tuple[int, int] | None:
    if value is None:
        return None
    ok = isinstance(value, list | tuple) and len(value) == 2
    ok = ok and all(isinstance(v, int) and v > 0 for v in value)
    # the kernel takes a group of columns per FP8 tl.dot: a power of two of at least 32
    ok = ok and value[1] >= 32 and value[1] & (value[1] - 1) == 0
    _require(ok, field, value, "[rows, columns], columns a power of two >= 32")
    return int(value[0]), int(value[1])


def _ignored(cfg: dict[str, Any]) -> tuple[str, ...]:
    return tuple(cfg.get("modules_to_not_convert") or cfg.get("ignored_layers") or ())


def _awq(cfg: dict[str, Any]) -> QuantSpec:
    bits = cfg.get("w_bit", cfg.get("bits", 4))
    _require(bits == 4, "bits", bits, "4")
    version = str(cfg.get("version", "gemm")).lower()
    _require(version == "gemm", "version", version, "gemm")
    group = _group_size(cfg.get("q_group_size", cfg.get("group_size", 128)), "group_size")
    return QuantSpec(
        "awq",
        from_checkpoint=True,
        group_size=group,
        symmetric=not cfg.get("zero_point", True),
        ignore=_ignored(cfg),
    )


def _gptq(cfg: dict[str, Any]) -> QuantSpec:
    bits = cfg.get("bits", 4)
    _require(bits == 4, "bits", bits, "4")
    fmt = cfg.get("checkpoint_format", "gptq")
    _require(fmt in ("gptq", "gptq_v2"), "checkpoint_format", fmt, "gptq, gptq_v2")
    dynamic = cfg.get("dynamic")
    _require(not dynamic, "dynamic", dynamic, "none: every module quantized alike")
    _require(not cfg.get("lm_head", False), "lm_head", True, "false: the lm_head stays float")
    return QuantSpec(
        "gptq",
        from_checkpoint=True,
        group_size=_group_size(cfg.get("group_size", 128), "group_size"),
        symmetric=bool(cfg.get("sym", True)),
        act_order=bool(cfg.get("desc_act", False)),
        zeros_minus_one=fmt == "gptq",
        ignore=_ignored(cfg),
    )


def _compressed_tensors(cfg: dict[str, Any]) -> QuantSpec:
    """One config group for every Linear: int4 weights (pack-quantized, W4A16), or FP8
    weights with FP8 activations (float-quantized): quantized per token at run time
    (llm-compressor's FP8_DYNAMIC), per token and group with block scales (FP8_BLOCK), or by
    a static scale per tensor (FP8)."""
    groups = cfg.get("config_groups") or {}
    if not groups and cfg.get("kv_cache_scheme") is not None:
        raise ValueError(
            "a compressed-tensors checkpoint that quantizes only the KV cache (no config_groups) "
            "is not supported; kvflow runs one config group of quantized Linear weights"
        )
    _require(len(groups) == 1, "config_groups", list(groups), "exactly one group")
    (scheme,) = groups.values()
    targets = scheme.get("targets")
    _require(targets == ["Linear"], "config_groups.targets", targets, '["Linear"]')
    fmt = scheme.get("format") or cfg.get("format")
    _require(fmt in ("pack-quantized", "float-quantized"), "format", fmt, _CT_FORMATS)
    weights = scheme.get("weights") or {}
    strategy = weights.get("strategy")
    ignore = tuple(cfg.get("ignore") or ())
    if fmt == "float-quantized":
        return _compressed_fp8(scheme, weights, strategy, ignore)
    _require(scheme.get("input_activations") is None, "input_activations", "set", "none: W4A16")
    kind = f"{weights.get('type', 'int')}{weights.get('num_bits')}"
    _require(kind == "int4", "weights", kind, "int4")
    _require(strategy in ("group", "channel"), "weights.strategy", strategy, "group, channel")
    group = -1 if strategy == "channel" else weights.get("group_size")
    return QuantSpec(
        "compressed-tensors",
        from_checkpoint=True,
        group_size=_group_size(group, "weights.group_size"),
        symmetric=bool(weights.get("symmetric", True)),
        act_order=weights.get("actorder") == "group",
        ignore=ignore,
    )


def _compressed_fp8(
    scheme: dict[str, Any], weights: dict[str, Any], strategy: Any, ignore: tuple[str, ...]
) -> QuantSpec:
    """A float-quantized compressed-tensors group: FP8 weights with FP8 activations."""
    kind = f"{weights.get('type')}{weights.get('num_bits')}"
    _require(kind == "float8", "weights", kind, "float8")
    strategies = ("tensor", "channel", "block")
    _require(strategy in strategies, "weights.strategy", strategy, ", ".join(strategies))
    block = None
    if strategy == "block":
        block = _fp8_block(weights.get("block_structure"), "weights.block_structure")
    act = scheme.get("input_activations") or {}
    fp8_act = f"{act.get('type')}{act.get('num_bits')}" == "float8"
    fp8_act = fp8_act and act.get("symmetric", True) is True
    dynamic_token = act.get("dynamic") is True and act.get("strategy") == "token"
    dynamic_group = act.get("dynamic") is True and act.get("strategy") == "group"
    static = act.get("dynamic") is False and act.get("strategy") == "tensor"
    if block is None:
        supported = "FP8, dynamic per token or static per tensor"
        _require(fp8_act and (dynamic_token or static), "input_activations", act, supported)
    else:
        same_group = fp8_act and dynamic_group and act.get("group_size") == block[1]
        _require(same_group, "input_activations", act, "FP8, dynamic, the block's groups")
    return QuantSpec(
        "compressed-tensors",
        True,
        ignore=ignore,
        fp8_weights=True,
        fp8_block=block,
        static_input=static,
    )


_CT_FORMATS = "pack-quantized (int4 W4A16), float-quantized (FP8 W8A8)"
