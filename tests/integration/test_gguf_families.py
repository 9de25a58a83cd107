"""GGUF files of the families llama.cpp publishes beyond Llama and Qwen: Gemma 2, Gemma 3,
Phi-3, OLMo 2 and Granite, written as llama.cpp's converter writes them
(`sweeps/gguf_writer.write_checkpoint`: its tensor names, Gemma's norms stored as 1 + w, each
family's metadata), give a tiny random model's greedy tokens under transformers, token for
token, past the sliding windows, with the prefix cache and chunked prefill. transformers' own
GGUF reader, which knows llama.cpp's conventions, reads the same weights back (where it reads
the family), so the file is what llama.cpp would write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from kvflow.llm import LLM
from sweeps.gguf_writer import write_checkpoint
from tests.integration.test_gguf_quantized import gguf_layers
from tests.integration.test_parity import hf_greedy, kvflow_greedy
from tests.integration.tiny_models import FAMILIES, TINY, TINY_ENGINE, make_prompts

# Per family, what its tiny model changes so that a GGUF file can hold it: Gemma 3's files
# carry no layer types (llama.cpp makes every sixth layer full), nor per-type rotary settings
# (the sliding layers' base is 10,000; a linear factor is the full layers').
GGUF_CASES: dict[str, dict[str, Any]] = {
    "llama": {},  # Llama 3's long-context rotary, stored as llama.cpp does: rope_freqs
    "gemma2": {},
    "gemma3_text": dict(
        num_hidden_layers=6,
        layer_types=None,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    ),
    "phi3": dict(pad_token_id=0),  # transformers' GGUF reader needs one inside the vocabulary
    "phi3 longrope": {},  # its two sets of frequencies as rope_factors_long / _short
    "olmo2": {},
    "granite": {},
}
# transformers reads no GGUF file of these: the file is checked by kvflow's tokens alone
NO_TRANSFORMERS_READER = ("olmo2", "granite", "phi3 longrope")


def tiny_model(family: str) -> transformers.PreTrainedModel:
    """The family's tiny model with random norms, each a multiple of 2^-10 so that Gemma's
    1 + w round-trips exactly in float32."""
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **extra, **GGUF_CASES[family]})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_((torch.randn_like(param) * 0.2 * 1024).round() / 1024)
    return model


@pytest.mark.parametrize("family", sorted(GGUF_CASES))
def test_llama_cpp_style_file_gives_transformers_tokens(family: str, tmp_path: Path) -> None:
    model = tiny_model(family)
    path = tmp_path / "model.gguf"
    write_checkpoint(path, model)
    if family not in NO_TRANSFORMERS_READER:
        read = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=path.name, dtype=torch.float32
        ).state_dict()
        for name, weight in model.state_dict().items():
            assert torch.equal(read[name], weight), name
    prompts = make_prompts(model.config.vocab_size)
    expected = hf_greedy(model, prompts, eos_token_id=None)
    options = dict(tokenizer=str(tmp_path), **TINY_ENGINE)
    llm = LLM(str(path), **options)
    assert kvflow_greedy(llm, prompts, ignore_eos=True) == expected
    assert kvflow_greedy(llm, prompts, ignore_eos=True) == expected  # from the prefix cache
    assert llm.stats().prefix_cache_hits > 0
    chunked = LLM(str(path), max_num_batched_tokens=16, **options)
    assert kvflow_greedy(chunked, prompts, ignore_eos=True) == expected


def test_phi3s_fused_quantized_projections_run_from_their_blocks(tmp_path: Path) -> None:
    """Phi-3's fused q/k/v and gate/up, stored as Q8_0 blocks, are cut row by row into the
    pieces the layers load: run from their blocks they give the tokens of the same file
    dequantized at load."""
    path = tmp_path / "model.gguf"
    write_checkpoint(path, tiny_model("phi3"), projection_type="Q8_0")
    prompts = make_prompts(TINY["vocab_size"])[:4]
    options = dict(tokenizer=str(tmp_path), **TINY_ENGINE)
    expected = kvflow_greedy(LLM(str(path), **options), prompts, ignore_eos=True)
    quantized = LLM(str(path), quantization="gguf", **options)
    assert {runs[0] for runs in gguf_layers(quantized).values()} == {"Q8_0"}
    assert len(gguf_layers(quantized)) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    assert kvflow_greedy(quantized, prompts, ignore_eos=True) == expected
