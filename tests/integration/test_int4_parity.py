"""int4 checkpoints (AWQ, GPTQ, compressed-tensors) run by kvflow give the greedy tokens of
transformers running the same model with the weights those checkpoints stand for, dequantized
(float32, CPU, token for token).

The checkpoints are written by tests/quantized_writers.py in each format's published layout; the
reference weights come from the writer's own integers, scales and zero points, so a layout
misread anywhere between the file and kvflow's kernels changes the tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvflow import LLM
from tests import quantized_writers
from tests.integration.test_parity import hf_greedy, kvflow_greedy
from tests.integration.tiny_models import TINY_ENGINE, make_prompts, make_tiny_model

pytest.importorskip("compressed_tensors")

WRITERS: dict[str, Callable[[torch.nn.Module, Path], None]] = {
    "awq-g32": lambda model, folder: quantized_writers.write_awq(model, folder, 32),
    "gptq-g32-sym": lambda model, folder: quantized_writers.write_gptq(
        model, folder, 32, True, False
    ),
    "gptq-g32-act-order": lambda model, folder: quantized_writers.write_gptq(
        model, folder, 32, False, True
    ),
    "ct-g32-asym": lambda model, folder: quantized_writers.write_compressed_tensors(
        model, folder, 32, False
    ),
    "ct-channel-sym": lambda model, folder: quantized_writers.write_compressed_tensors(
        model, folder, None, True
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_int4_checkpoint_matches_transformers_on_its_dequantized_weights(
    family: str, fmt: str, tmp_path: Path
) -> None:
    model = make_tiny_model(family)
    prompts = make_prompts(model.config.vocab_size)
    plain = hf_greedy(model, prompts, eos_token_id=None)
    WRITERS[fmt](model, tmp_path)  # the model now holds the dequantized weights
    expected = hf_greedy(model, prompts, eos_token_id=None)
    assert expected != plain  # the quantization changes the output
    llm = LLM(str(tmp_path), **TINY_ENGINE)  # the method: from config.json
    assert kvflow_greedy(llm, prompts, ignore_eos=True) == expected


def test_int4_methods_run_on_dummy_weights(tmp_path: Path) -> None:
    model = make_tiny_model("llama")
    model.config.save_pretrained(tmp_path)
    prompts = make_prompts(model.config.vocab_size)[:2]
    for method in ("awq", "gptq", "compressed-tensors"):
        llm = LLM(str(tmp_path), **TINY_ENGINE, load_format="dummy", quantization=method)
        assert all(len(tokens) == 64 for tokens in kvflow_greedy(llm, prompts, ignore_eos=True))


def test_a_checkpoint_that_leaves_a_projection_unquantized_is_refused(tmp_path: Path) -> None:
    model = make_tiny_model("llama")
    quantized_writers.write_compressed_tensors(model, tmp_path, 32, symmetric=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"leaves model\.layers\.1\.mlp\.down_proj unquantized"):
        LLM(str(tmp_path), **TINY_ENGINE)
