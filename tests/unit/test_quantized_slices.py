"""A tensor-parallel rank loading a quantized checkpoint reads only its share of the packed
weights (services/executor/quantization/checkpoints.py translates lazily), and loads exactly what
it loads when every tensor is read and translated whole first: for each int4 and FP8 layout,
with a KV head of its own or one shared by both ranks. Nothing here runs a forward pass."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import EllipsisType

import pytest
import torch
import transformers
from safetensors.torch import load_file

from services.executor.loading.weights import load_weights
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.parallel.shards import CheckpointSlice, Loaded, read
from services.executor.parallel.tensor_parallel import TensorParallel
from services.executor.quantization.checkpoints import translate_quantized
from services.executor.quantization.methods import linear_method
from shared.model_config import ModelSource, from_hf_dict
from shared.quant_config import QuantSpec, read_quant_spec
from tests import quantized_writers
from tests.integration.tiny_models import TINY

pytest.importorskip("compressed_tensors")

Writer = Callable[[torch.nn.Module, Path], object]
WRITERS: dict[str, Writer] = {
    "awq-g32": lambda model, folder: quantized_writers.write_awq(model, folder, 32),
    "gptq-g32-act-order": lambda model, folder: quantized_writers.write_gptq(
        model, folder, 32, symmetric=False, act_order=True
    ),
    "gptq-g32-sym": lambda model, folder: quantized_writers.write_gptq(
        model, folder, 32, symmetric=True, act_order=False
    ),
    "ct-g32-asym": lambda model, folder: quantized_writers.write_compressed_tensors(
        model, folder, 32, symmetric=False
    ),
    "ct-channel-sym": lambda model, folder: quantized_writers.write_compressed_tensors(
        model, folder, None, symmetric=True
    ),
    "fp8-tensor": lambda model, folder: quantized_writers.write_fp8(model, folder, True),
    "fp8-channel": lambda model, folder: quantized_writers.write_fp8(model, folder, False),
    # blocks of 32 rows: a rank's 16 rows of K or V sit inside one
    "fp8-block": lambda model, folder: quantized_writers.write_fp8_block(
        model, folder, (32, 32), compressed=False
    ),
    "fp8-block-ct": lambda model, folder: quantized_writers.write_fp8_block(
        model, folder, (32, 32), compressed=True
    ),
}
PACKED = ("qweight", "weight_packed", "weight")  # the parts that hold a projection's values


class CountingPart:
    """A checkpoint tensor as `CheckpointSlice` reads one, counting the entries read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.entries_read = tensor, 0

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: tuple[slice, ...] | EllipsisType) -> torch.Tensor:
        part = self.tensor[index]
        self.entries_read += part.numel()
        return part


def write(tmp_path: Path, fmt: str, kv_heads: int) -> tuple[Path, QuantSpec, object]:
    hf_config = transformers.LlamaConfig(**TINY | {"num_key_value_heads": kv_heads})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    folder = tmp_path / fmt
    WRITERS[fmt](model, folder)
    source = ModelSource(folder, "safetensors", fmt)
    spec = read_quant_spec(None, source, "auto", device_type="cpu")
    assert spec is not None and spec.from_checkpoint
    cfg = from_hf_dict(hf_config.to_dict() | {"model_type": "llama"})
    return folder, spec, cfg


def translated(tensors: dict[str, Loaded], spec: QuantSpec) -> Iterator[tuple[str, Loaded]]:
    return translate_quantized(tensors.items(), set(tensors), spec)


def rank_state(
    cfg: object, spec: QuantSpec, weights: Iterable[tuple[str, Loaded]], rank: int
) -> dict[str, torch.Tensor]:
    """What rank `rank` of two loads of the translated tensors `weights`."""
    model = DecoderForCausalLM(cfg, 64, linear_method(spec), tp=TensorParallel(rank, 2))  # type: ignore[arg-type]
    load_weights(model, weights)
    return model.state_dict()


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["own-kv", "shared-kv"])
@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_a_rank_reads_its_share_and_loads_what_whole_tensors_give(
    tmp_path: Path, fmt: str, kv_heads: int
) -> None:
    folder, spec, cfg = write(tmp_path, fmt, kv_heads)
    stored = load_file(str(folder / "model.safetensors"))
    for rank in range(2):
        # The reference: every tensor translated and read whole, then cut by the model.
        whole = [(name, read(t)) for name, t in translated(dict(stored), spec)]
        expected = rank_state(cfg, spec, whole, rank)
        parts = {name: CountingPart(tensor) for name, tensor in stored.items()}
        slices: dict[str, Loaded] = {n: CheckpointSlice(p) for n, p in parts.items()}
        got = rank_state(cfg, spec, translated(slices, spec), rank)
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), (fmt, rank, name)
        for name, part in parts.items():
            module, _, leaf = name.rpartition(".")
            if leaf not in PACKED or not module.endswith("_proj"):
                continue
            shared = kv_heads == 1 and module.endswith(("k_proj", "v_proj"))
            share = part.tensor.numel() // (1 if shared else 2)
            assert part.entries_read == share, (fmt, rank, name)


def counted(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Loaded], dict[str, CountingPart]]:
    parts = {name: CountingPart(tensor) for name, tensor in tensors.items()}
    return {name: CheckpointSlice(part) for name, part in parts.items()}, parts


def test_a_cut_inside_packed_words_or_blocks_reads_only_those_holding_it(tmp_path: Path) -> None:
    """A cut of rows that starts and ends inside a packed word or a scale block reads the
    words or blocks holding it, no more, and crops them: AWQ's 8 rows a word, FP8 scales per
    32-row block, compressed-tensors zero points of 20 rows (3 words, the last one padded),
    and FP8 scales per channel stored as [1, N]."""
    module = "model.layers.0.self_attn.q_proj"
    cases = []  # (tensors, spec, translated name, rows cut, checkpoint part, entries read)
    for fmt, part, entries in (
        ("awq-g32", "qweight", 64 * 2),
        ("fp8-block", "weight_scale_inv", 2),
    ):
        folder, spec, _ = write(tmp_path, fmt, 2)
        stored = load_file(str(folder / "model.safetensors"))
        tensors = {n: t for n, t in stored.items() if n.startswith(module + ".")}
        translated_name = "qweight" if part == "qweight" else "weight_scale"
        cases.append((tensors, spec, translated_name, (3, 13), part, entries))
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    zeros = torch.randint(-8, 8, (20, 2), dtype=torch.int8)  # N = 20, two groups of 32
    ct_tensors = {
        "m.weight_packed": torch.zeros(20, 8, dtype=torch.int32),
        "m.weight_scale": torch.ones(20, 2),
        "m.weight_shape": torch.tensor([20, 64]),
        "m.weight_zero_point": ct.pack_to_int32(zeros, 4, packed_dim=0),  # [3, 2]
    }
    ct_spec = QuantSpec("compressed-tensors", True, group_size=32, symmetric=False)
    cases.append((ct_tensors, ct_spec, "zeros", (17, 20), "weight_zero_point", 2))
    fp8_tensors = {
        "m.weight": torch.randn(12, 32).to(torch.float8_e4m3fn),
        "m.weight_scale": torch.arange(12.0).reshape(1, 12),
    }
    cases.append((fp8_tensors, QuantSpec("fp8", True), "weight_scale", (5, 9), "weight_scale", 4))
    for tensors, spec, name, (start, stop), part, entries in cases:
        whole = {n: read(t) for n, t in translated(dict(tensors), spec)}
        slices, parts = counted(tensors)
        lazy = dict(translated(slices, spec))
        prefix = next(n.rpartition(".")[0] for n in tensors if n.endswith(part))
        cut = lazy[f"{prefix}.{name}"].narrow(0, start, stop - start)
        torch.testing.assert_close(cut, whole[f"{prefix}.{name}"][start:stop])
        assert parts[f"{prefix}.{part}"].entries_read == entries, (name, part)
