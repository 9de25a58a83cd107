"""int4 experts (W4A16): AWQ, GPTQ and compressed-tensors checkpoints of a mixture of experts,
each expert's projections stored apart in the format's layout as the published Qwen3-MoE
checkpoints store them, give the greedy tokens of transformers running the model on the
weights those checkpoints stand for (dequantized, float32, CPU).

The dense projections are written by tests/quantized_writers.py; the experts here, with its
quantizer and packers, so that a layout misread anywhere between the file and the experts'
kernels changes the tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvflow import LLM
from services.executor.quantization.int4 import Int4Experts
from shared.quant_config import QuantSpec
from tests import quantized_writers
from tests.integration.test_moe_fp8 import tiny_moe
from tests.integration.test_parity import hf_greedy, kvflow_greedy
from tests.integration.tiny_models import make_prompts

pytest.importorskip("compressed_tensors")

Pack = Callable[[str, quantized_writers.Quantized], dict[str, torch.Tensor]]
# format -> (the dense writer, the experts' packer, group size (None: one a row), symmetric)
FORMATS: dict[str, tuple[Callable[[torch.nn.Module, Path], None], Pack, int | None, bool]] = {
    "awq-g32": (
        lambda model, folder: quantized_writers.write_awq(model, folder, 32),
        quantized_writers.awq_tensors, 32, False,
    ),
    "gptq-g32-sym": (
        lambda model, folder: quantized_writers.write_gptq(model, folder, 32, True, False),
        quantized_writers.gptq_tensors, 32, True,
    ),
    "ct-g32-asym": (
        lambda model, folder: quantized_writers.write_compressed_tensors(model, folder, 32, False),
        lambda name, layer: quantized_writers.compressed_tensors_tensors(name, layer, False),
        32, False,
    ),
    "ct-channel-sym": (
        lambda model, folder: quantized_writers.write_compressed_tensors(model, folder, None, True),
        lambda name, layer: quantized_writers.compressed_tensors_tensors(name, layer, True),
        None, True,
    ),
}  # fmt: skip


def write_int4_experts(
    model: torch.nn.Module, folder: Path, pack: Pack, group: int | None, symmetric: bool
) -> None:
    """The experts as int4 checkpoints of mixtures of experts publish them, packed by `pack`
    (quantized_writers.write_experts_apart)."""

    def write(prefix: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q = quantized_writers.quantize(weight, group or weight.shape[1], symmetric, None)
        return pack(prefix, q), q.dequantized()

    quantized_writers.write_experts_apart(model, folder, write)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_int4_expert_checkpoints_match_transformers_on_their_dequantized_weights(
    fmt: str, tmp_path: Path
) -> None:
    write_dense, pack, group, symmetric = FORMATS[fmt]
    model = tiny_moe("qwen3_moe")
    prompts = make_prompts(model.config.vocab_size)
    plain = hf_greedy(model, prompts, eos_token_id=None)
    write_dense(model, tmp_path)
    write_int4_experts(model, tmp_path, pack, group, symmetric)
    expected = hf_greedy(model, prompts, eos_token_id=None)
    assert expected != plain  # the quantization changes the output
    llm = LLM(str(tmp_path), dtype="float32", device="cpu")  # the method: from config.json
    assert kvflow_greedy(llm, prompts, ignore_eos=True) == expected
    experts = llm.runner.model.layers[0].mlp
    assert experts.experts_down.dtype == torch.int32
    assert hasattr(experts, "experts_down_zeros") != symmetric


def test_int4_experts_run_on_dummy_weights(tmp_path: Path) -> None:
    """Groups of 128 (the methods' default without a checkpoint), with and without zero
    points."""
    config = tiny_moe("qwen3_moe").config
    config.hidden_size = config.moe_intermediate_size = 128
    config.save_pretrained(tmp_path)
    prompts = make_prompts(64)[:2]
    for method in ("awq", "gptq", "compressed-tensors"):
        llm = LLM(str(tmp_path), dtype="float32", device="cpu", load_format="dummy",
                  quantization=method)  # fmt: skip
        assert all(len(tokens) == 64 for tokens in kvflow_greedy(llm, prompts, ignore_eos=True))


def test_what_int4_experts_cannot_run_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="act-order"):
        Int4Experts(QuantSpec("gptq", from_checkpoint=True, act_order=True))
    config = tiny_moe("qwen3_moe dense first").config  # experts 24 columns wide
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="int4 experts need input columns and groups"):
        LLM(str(tmp_path), dtype="float32", device="cpu", load_format="dummy", quantization="awq")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "expert_parallel"), [("awq-g32", False), ("gptq-g32-sym", True)],
    ids=["columns-split", "expert-parallel"],
)  # fmt: skip
def test_int4_experts_on_two_ranks_give_the_tokens_of_one(
    tmp_path: Path, fmt: str, expert_parallel: bool
) -> None:
    """Each rank cuts its half of every expert's packed words, scales and zero points (each
    expert 64 columns wide: 32 a rank, a group each), or with --enable-expert-parallel holds
    half the experts whole; both give transformers' tokens on the dequantized weights."""
    from tests.integration.test_tensor_parallel import NUM_TOKENS, greedy, tiny_folder

    write_dense, pack, group, symmetric = FORMATS[fmt]
    folder, model = tiny_folder(tmp_path, "qwen3_moe", moe_intermediate_size=64)
    write_dense(model, folder)
    write_int4_experts(model, folder, pack, group, symmetric)
    prompts = make_prompts(model.config.vocab_size)[:4]
    expected = hf_greedy(model, prompts, NUM_TOKENS, eos_token_id=None)
    tokens = greedy(tmp_path, 2, str(folder), prompts, enable_expert_parallel=expert_parallel)
    assert tokens == expected
