"""`kvflow bench`'s reading of a model: the parameters a step multiplies by are those of
transformers' own linear layers, whatever kvflow fuses (qkv, gate_up, a gated MLP's down
projection fed from gate_up)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.engine_bench import _matmul_parameters
from kvflow.llm import LLM
from tests.integration.tiny_models import make_tiny_model


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_matmul_parameters_are_transformers_linear_layers(family: str, tmp_path: Path) -> None:
    reference = make_tiny_model(family)
    reference.save_pretrained(tmp_path)
    expected = sum(
        m.in_features * m.out_features
        for m in reference.modules()
        if isinstance(m, torch.nn.Linear)
    )
    model = LLM(str(tmp_path), dtype="float32", device="cpu").runner.model
    assert _matmul_parameters(model) == expected
