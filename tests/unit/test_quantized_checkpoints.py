"""The quantized checkpoint layouts (services/executor/quantization/checkpoints.py) and
quantization configs (shared/quant_config.py): kvflow's reading of AWQ and compressed-tensors
int4 tensors is checked against the compressed-tensors package, which unpacks both
independently; GPTQ's against words worked out by hand from its definition; FP8 scales per
tensor and per channel."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.int4 import unpack_weight
from services.executor.parallel.shards import read
from services.executor.quantization.checkpoints import translate_quantized
from shared.model_config import ModelSource
from shared.quant_config import QuantSpec, read_quant_spec
from tests import quantized_writers

ct_helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")


def translated(tensors: dict[str, torch.Tensor], spec: QuantSpec) -> dict[str, torch.Tensor]:
    return {n: read(t) for n, t in translate_quantized(tensors.items(), set(tensors), spec)}


def random_layer(n: int, k: int, group_size: int, symmetric: bool) -> quantized_writers.Quantized:
    generator = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=generator)
    return quantized_writers.quantize(weight, group_size, symmetric, None)


def test_awq_reads_as_compressed_tensors_converts_it() -> None:
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    layer = random_layer(24, 64, 32, symmetric=False)
    awq = {
        "m.qweight": quantized_writers.to_int32(quantized_writers.awq_pack_columns(layer.q.T)),
        "m.qzeros": quantized_writers.to_int32(quantized_writers.awq_pack_columns(layer.zeros.T)),
        "m.scales": layer.scales.t().contiguous(),
    }
    ours = translated(dict(awq), QuantSpec("awq", from_checkpoint=True, group_size=32))
    converted = AutoAWQConverter(group_size=32).process(dict(awq))
    # compressed-tensors' convention: signed values and zero points (ours + 8).
    values = ct_helpers.unpack_from_int32(converted["m.weight_packed"], 4, torch.Size((24, 64)))
    zeros = ct_helpers.unpack_from_int32(
        converted["m.weight_zero_point"], 4, torch.Size((24, 2)), packed_dim=0
    )
    assert torch.equal(unpack_weight(ours["m.qweight"]).int(), values.int() + 8)
    assert torch.equal(ours["m.zeros"].int(), zeros.int() + 8)
    assert torch.equal(ours["m.scales"], converted["m.weight_scale"])
    assert torch.equal(unpack_weight(ours["m.qweight"]).long(), torch.from_numpy(layer.q))


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_packing_reads_back_its_values(symmetric: bool) -> None:
    layer = random_layer(20, 64, 32, symmetric)  # N = 20: zero points padded to 3 words
    signed = torch.from_numpy(layer.q - 8).to(torch.int8)
    tensors = {
        "m.weight_packed": ct_helpers.pack_to_int32(signed, 4),
        "m.weight_scale": layer.scales,
        "m.weight_shape": torch.tensor([20, 64]),
    }
    if not symmetric:
        zero = torch.from_numpy(layer.zeros - 8).to(torch.int8)
        tensors["m.weight_zero_point"] = ct_helpers.pack_to_int32(zero, 4, packed_dim=0)
    spec = QuantSpec("compressed-tensors", True, group_size=32, symmetric=symmetric)
    ours = translated(tensors, spec)
    assert torch.equal(unpack_weight(ours["m.qweight"]).long(), torch.from_numpy(layer.q))
    if symmetric:
        assert "m.zeros" not in ours
    else:
        assert torch.equal(ours["m.zeros"].long(), torch.from_numpy(layer.zeros))


def test_gptq_words_as_defined() -> None:
    # Input columns 0..7 of output column 0 hold 0..7: one qweight word 0x76543210. Its zero
    # point 9 is stored minus one (8) in the first nibble of qzeros.
    q = np.zeros((8, 32), dtype=np.int64)  # [N, K]
    q[0, :8] = np.arange(8)
    zeros = np.full((8, 1), 9)  # [N, G]
    tensors = {
        "m.qweight": quantized_writers.to_int32(quantized_writers.gptq_pack(q.T, along_rows=True)),
        "m.qzeros": quantized_writers.to_int32(
            quantized_writers.gptq_pack(zeros.T - 1, along_rows=False)
        ),
        "m.scales": torch.ones(1, 8, dtype=torch.float16),
        "m.g_idx": torch.zeros(32, dtype=torch.int32),
    }
    assert int(tensors["m.qweight"][0, 0]) == 0x76543210
    assert int(tensors["m.qzeros"][0, 0]) & 0xF == 8
    spec = QuantSpec("gptq", True, group_size=-1, zeros_minus_one=True)
    ours = translated(tensors, spec)
    # [N, K/8]: word c of the 32-column chunk holds columns 8p + 2c + {0, 1} in its byte p.
    assert ours["m.qweight"][0, :4].tolist() == [0x10, 0x32, 0x54, 0x76]
    assert ours["m.zeros"][:, 0].tolist() == [9] * 8
    assert "m.g_idx" not in ours  # in order: the kernels compute it


def test_unquantized_tensors_pass_through_and_missing_parts_are_named() -> None:
    spec = QuantSpec("awq", True, group_size=32)
    other = torch.ones(3)
    assert translated({"norm.weight": other}, spec) == {"norm.weight": other}
    with pytest.raises(ValueError, match=r"lacks.*scales"):
        translated({"m.qweight": torch.zeros(64, 1, dtype=torch.int32)}, spec)


def source_with(tmp_path: Path, quantization_config: dict[str, object] | None) -> ModelSource:
    config: dict[str, object] = {"model_type": "llama"}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ModelSource(tmp_path, "safetensors", "tiny")


def test_the_checkpoint_config_decides_and_a_contrary_flag_is_refused(tmp_path: Path) -> None:
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": False}
    spec = read_quant_spec(None, source_with(tmp_path, gptq), "auto", device_type="cpu")
    assert spec == QuantSpec(
        "gptq", True, group_size=64, symmetric=False, act_order=True, zeros_minus_one=True
    )
    assert read_quant_spec("gptq", source_with(tmp_path, gptq), "auto", device_type="cpu") == spec
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        read_quant_spec("awq", source_with(tmp_path, gptq), "auto", device_type="cpu")


def fp8_channel_config(input_activations: dict[str, object] | None) -> dict[str, object]:
    """A compressed-tensors FP8 config with per-channel weights and these activations."""
    weights = {"num_bits": 8, "type": "float", "strategy": "channel"}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": input_activations}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"g": group},
    }


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"quant_method": "gptq", "bits": 8}, "bits"),
        ({"quant_method": "awq", "version": "gemv"}, "version"),
        ({"quant_method": "gptq", "group_size": 100}, "group_size"),
        ({"quant_method": "bitsandbytes"}, "quant_method"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4}}},
            },
            "format",
        ),
        ({"quant_method": "fp8", "weight_block_size": [128, 100]}, "weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 16]}, "weight_block_size"),
        ({"quant_method": "gptq", "dynamic": {"-:.*down_proj": {}}}, "dynamic"),
        ({"quant_method": "gptq", "lm_head": True}, "lm_head"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"targets": ["Linear"]}},
                "kv_cache_scheme": {"num_bits": 8, "type": "float"},
            },
            "kv_cache_scheme",
        ),
        ({"quant_method": "fp8", "activation_scheme": "per-group"}, "activation_scheme"),
        (
            {
                "quant_method": "fp8",
                "activation_scheme": "static",
                "weight_block_size": [128, 128],
            },
            "activation_scheme",
        ),
        (  # static activations need one scale per tensor
            fp8_channel_config(
                {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}
            ),
            "input_activations",
        ),
        (fp8_channel_config(None), "input_activations"),  # W8A16: not run yet
    ],
)
def test_unsupported_configs_are_refused_by_field(
    tmp_path: Path, config: dict[str, object], field: str
) -> None:
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        read_quant_spec(None, source_with(tmp_path, config), "auto", device_type="cpu")


def test_int4_flags_without_a_checkpoint_need_dummy_weights(tmp_path: Path) -> None:
    source = source_with(tmp_path, None)
    assert read_quant_spec(None, source, "auto", device_type="cpu") is None
    assert read_quant_spec("fp8", source, "auto", device_type="cpu") == QuantSpec(
        "fp8", from_checkpoint=False
    )
    assert read_quant_spec("awq", source, "dummy", device_type="cpu") == QuantSpec(
        "awq", from_checkpoint=False
    )
    with pytest.raises(ValueError, match="needs a checkpoint quantized with gptq"):
        read_quant_spec("gptq", source, "auto", device_type="cpu")


def test_mxfp4_checkpoints_keep_their_experts_or_take_fp8_and_refuse_the_rest(
    tmp_path: Path,
) -> None:
    (tmp_path / "mxfp4").mkdir(), (tmp_path / "plain").mkdir()
    mxfp4 = source_with(tmp_path / "mxfp4", {"quant_method": "mxfp4"})
    kept = QuantSpec("mxfp4", from_checkpoint=True)
    assert read_quant_spec(None, mxfp4, "auto", device_type="cuda") == kept
    assert read_quant_spec("mxfp4", mxfp4, "auto", device_type="cpu") == kept
    assert read_quant_spec(None, mxfp4, "auto", device_type="cpu") is None  # dequantized
    fp8 = read_quant_spec("fp8", mxfp4, "auto", device_type="cpu")
    assert fp8 == QuantSpec("fp8", from_checkpoint=False)
    with pytest.raises(ValueError, match="--quantization awq does not apply to an MXFP4"):
        read_quant_spec("awq", mxfp4, "auto", device_type="cpu")
    plain = source_with(tmp_path / "plain", None)
    dummy = read_quant_spec("mxfp4", plain, "dummy", device_type="cpu")
    assert dummy == QuantSpec("mxfp4", from_checkpoint=False)
    with pytest.raises(ValueError, match="needs a checkpoint quantized with mxfp4"):
        read_quant_spec("mxfp4", plain, "auto", device_type="cpu")


def test_gguf_files_keep_their_blocks_on_cuda_and_on_request(tmp_path: Path) -> None:
    gguf_file = ModelSource(tmp_path / "model.gguf", "gguf", "model")
    gguf_spec = QuantSpec("gguf", from_checkpoint=True)
    assert read_quant_spec(None, gguf_file, "auto", device_type="cuda") == gguf_spec
    assert (
        read_quant_spec(None, gguf_file, "auto", device_type="cpu") is None
    )  # dequantized at load
    assert read_quant_spec("gguf", gguf_file, "auto", device_type="cpu") == gguf_spec
    assert read_quant_spec("fp8", gguf_file, "auto", device_type="cuda") == QuantSpec("fp8", False)
    with pytest.raises(ValueError, match="does not apply to a GGUF file"):
        read_quant_spec("gptq", gguf_file, "auto", device_type="cuda")
    with pytest.raises(ValueError, match=r"needs a \.gguf model file"):
        read_quant_spec("gguf", source_with(tmp_path, None), "auto", device_type="cuda")


def test_ignore_entries_match_as_their_formats_define() -> None:
    spec = QuantSpec("compressed-tensors", True, ignore=("lm_head", "re:.*layers\\.1\\..*"))
    assert spec.ignores("lm_head") and spec.ignores("model.layers.1.mlp.down_proj")
    assert not spec.ignores("model.layers.0.mlp.down_proj")


def test_fp8_scales_per_tensor_and_per_channel_become_per_channel() -> None:
    weight = torch.randn(6, 16).to(torch.float8_e4m3fn)
    spec = QuantSpec("fp8", True)
    for scale, want in [
        (torch.tensor(0.5), [0.5] * 6),  # per tensor, as a scalar
        (torch.tensor([0.25]), [0.25] * 6),
        (torch.arange(6.0).reshape(6, 1), list(range(6))),  # per channel, [N, 1]
    ]:
        parts = {"m.weight": weight, "m.weight_scale": scale, "m.input_scale": torch.ones(1)}
        ours = translated(parts, spec)
        assert set(ours) == {"m.qweight", "m.weight_scale"}  # input_scale is not read
        assert ours["m.weight_scale"].tolist() == want
        assert torch.equal(ours["m.qweight"].float(), weight.float())
    with pytest.raises(ValueError, match="the config names no block size"):
        translated({"m.weight": weight, "m.weight_scale": torch.ones(2, 2)}, spec)
    unquantized = {"norm.weight": torch.ones(16)}  # no weight_scale: not an FP8 module
    assert translated(unquantized, spec) == unquantized


def test_block_scales_become_one_per_row_and_group_of_columns() -> None:
    weight = torch.randn(40, 64).to(torch.float8_e4m3fn)  # 40 rows: a partial block of 16
    scale = torch.arange(6.0).reshape(3, 2)  # [ceil(40 / 16), 64 / 32]
    for spec, name in [
        (QuantSpec("fp8", True, fp8_block=(16, 32)), "weight_scale_inv"),  # transformers
        (
            QuantSpec("compressed-tensors", True, fp8_weights=True, fp8_block=(16, 32)),
            "weight_scale",
        ),
    ]:
        ours = translated({"m.weight": weight, f"m.{name}": scale}, spec)
        assert torch.equal(ours["m.qweight"].float(), weight.float())
        assert torch.equal(ours["m.weight_scale"], scale.repeat_interleave(16, 0)[:40])
        with pytest.raises(ValueError, match=r"do not tile weight \(40, 64\) in blocks of"):
            translated({"m.weight": weight, f"m.{name}": torch.ones(2, 2)}, spec)


def test_block_fp8_configs_are_read_from_both_formats(tmp_path: Path) -> None:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import FP8_BLOCK

    transformers_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    spec = read_quant_spec(
        None, source_with(tmp_path, transformers_config), "auto", device_type="cpu"
    )
    assert spec == QuantSpec("fp8", True, fp8_block=(128, 128))
    assert spec.checkpoint_format == "fp8_block"  # scales named weight_scale_inv
    ct = QuantizationConfig(
        config_groups={"g": QuantizationScheme(targets=["Linear"], **FP8_BLOCK)},
        format="float-quantized",
    ).model_dump(mode="json")
    ct["quant_method"] = "compressed-tensors"
    spec = read_quant_spec(None, source_with(tmp_path, ct), "auto", device_type="cpu")
    assert spec is not None and spec.fp8_block == (128, 128) and spec.checkpoint_format == "fp8"
    ct["config_groups"]["g"]["input_activations"]["group_size"] = 64  # not the block's columns
    with pytest.raises(ValueError, match=r"quantization_config\.input_activations"):
        read_quant_spec(None, source_with(tmp_path, ct), "auto", device_type="cpu")


def test_zero_points_that_contradict_the_config_are_refused() -> None:
    layer = random_layer(16, 64, 32, symmetric=False)  # zero points other than 8
    awq = {
        "m.qweight": quantized_writers.to_int32(quantized_writers.awq_pack_columns(layer.q.T)),
        "m.qzeros": quantized_writers.to_int32(quantized_writers.awq_pack_columns(layer.zeros.T)),
        "m.scales": layer.scales.t().contiguous(),
    }
    symmetric = QuantSpec("awq", True, group_size=32, symmetric=True)
    with pytest.raises(ValueError, match="zero points are not 8"):
        translated(awq, symmetric)
    ct = {
        "m.weight_packed": ct_helpers.pack_to_int32(torch.zeros(16, 64, dtype=torch.int8), 4),
        "m.weight_scale": layer.scales,
        "m.weight_shape": torch.tensor([16, 64]),
        "m.weight_zero_point": torch.zeros(16, 2, dtype=torch.int8),  # not packed
    }
    with pytest.raises(ValueError, match="weight_zero_point"):
        translated(ct, QuantSpec("compressed-tensors", True, group_size=32, symmetric=False))


FP8_CT = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "g": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
}
KV_SCHEME = {  # as llm-compressor writes it
    "num_bits": 8,
    "type": "float",
    "strategy": "tensor",
    "dynamic": False,
    "symmetric": True,
    "group_size": None,
    "observer": "minmax",
}


def test_an_fp8_kv_cache_scheme_is_read(tmp_path: Path) -> None:
    config = {**FP8_CT, "kv_cache_scheme": KV_SCHEME}
    spec = read_quant_spec(None, source_with(tmp_path, config), "auto", device_type="cpu")
    assert spec is not None and spec.kv_scales and spec.fp8_weights
    plain = read_quant_spec(None, source_with(tmp_path, FP8_CT), "auto", device_type="cpu")
    assert plain is not None and not plain.kv_scales


@pytest.mark.parametrize(
    "change",
    [{"dynamic": True}, {"strategy": "attn_head"}, {"symmetric": False}, {"num_bits": 4}],
    ids=["dynamic", "per-head", "asymmetric", "int4"],
)
def test_other_kv_cache_schemes_are_refused(tmp_path: Path, change: dict[str, object]) -> None:
    config = {**FP8_CT, "kv_cache_scheme": {**KV_SCHEME, **change}}
    with pytest.raises(ValueError, match=r"quantization_config\.kv_cache_scheme"):
        read_quant_spec(None, source_with(tmp_path, config), "auto", device_type="cpu")
    config = {**FP8_CT, "kv_cache_scheme": "fp8"}  # not a scheme at all
    with pytest.raises(ValueError, match=r"quantization_config\.kv_cache_scheme"):
        read_quant_spec(None, source_with(tmp_path, config), "auto", device_type="cpu")


def test_a_checkpoint_quantizing_only_the_kv_cache_is_refused_by_name(tmp_path: Path) -> None:
    config = {**FP8_CT, "config_groups": {}, "kv_cache_scheme": KV_SCHEME}
    with pytest.raises(ValueError, match="quantizes only the KV cache"):
        read_quant_spec(None, source_with(tmp_path, config), "auto", device_type="cpu")
