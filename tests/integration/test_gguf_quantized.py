"""GGUF files run from their blocks (`--quantization gguf`, the default on CUDA) give the same
greedy tokens (float32, CPU) as the same file dequantized to float at load, whose weights come
from the `gguf` package's own dequantization: the embedded SmolLM2 (Q4_1) and tiny Llama and
Qwen3 files with a different type on every projection, fused ones mixing types."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from kvflow.llm import LLM
from services.executor.layers.linear import Linear
from services.executor.parallel.shards import PackedWeight
from services.executor.quantization.gguf import GgufBlocks
from sweeps.gguf_writer import Shape, write_gguf
from tests.integration.test_parity import kvflow_greedy
from tests.integration.tiny_models import make_prompts

# Per layer, a type per projection: fused q/k/v and gate/up mix types (one kernel per run of
# rows of one type); F16 and Q3_K (no kernel) are dequantized at load, inside a fused layer.
MIXES = (
    {
        "attn_q": "Q4_K",
        "attn_k": "Q5_K",
        "attn_v": "Q6_K",
        "attn_output": "Q8_0",
        "ffn_gate": "Q4_0",
        "ffn_up": "Q4_1",
        "ffn_down": "Q5_K",
    },
    {
        "attn_q": "Q5_0",
        "attn_k": "F16",
        "attn_v": "Q3_K",
        "attn_output": "Q5_1",
        "ffn_gate": "Q6_K",
        "ffn_up": "Q6_K",
        "ffn_down": "Q4_K",
    },
)
TINY = dict(vocab_size=384, hidden_size=256, intermediate_size=512, num_layers=2)


def gguf_layers(llm: LLM) -> dict[str, list[str]]:
    """Each quantized projection's runs of GGUF types, by module name."""
    return {
        name: module.runs
        for name, module in llm.runner.model.named_modules()
        if isinstance(module, Linear) and isinstance(module.method, GgufBlocks)
    }


@pytest.mark.slow
def test_the_embedded_q4_1_model_runs_from_its_blocks(smollm2: LLM) -> None:
    prompts = [[1, 504, 3458, 282, 4649, 314], [28, 2657, 30, 216, 567, 17, 8, 41]]
    dequantized = smollm2  # the session's: LLM(device="cpu", dtype="float32", max_model_len=2048)
    assert gguf_layers(dequantized) == {}  # on CPU the default is float
    # 16 tokens: each step dequantizes every block on the CPU (suite time).
    expected = kvflow_greedy(dequantized, prompts, ignore_eos=True, num_new_tokens=16)
    quantized = LLM(device="cpu", dtype="float32", quantization="gguf")
    layers = gguf_layers(quantized)
    assert len(layers) == 30 * 4 and all(runs == ["Q4_1"] for runs in layers.values())
    assert kvflow_greedy(quantized, prompts, ignore_eos=True, num_new_tokens=16) == expected


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_types_match_the_dequantized_file(arch: str, tmp_path: Path) -> None:
    shape = Shape(arch, **TINY, num_heads=4, num_kv_heads=2, head_dim=64, context_length=512)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, shape, lambda layer, piece: MIXES[layer][piece], std=0.05)
    prompts = make_prompts(shape.vocab_size)[:4]
    options = dict(tokenizer=str(tmp_path), device="cpu", dtype="float32")
    expected = kvflow_greedy(LLM(str(path), **options), prompts, ignore_eos=True)
    assert all(len(set(tokens)) > 8 for tokens in expected)  # not one repeated token
    quantized = LLM(str(path), quantization="gguf", **options)
    layers = gguf_layers(quantized)
    assert layers["layers.0.self_attn.qkv_proj"] == ["Q4_K", "Q5_K", "Q6_K"]
    assert layers["layers.1.self_attn.qkv_proj"] == ["Q5_0", "float"]
    assert layers["layers.1.mlp.gate_up_proj"] == ["Q6_K"]
    assert kvflow_greedy(quantized, prompts, ignore_eos=True) == expected


def test_the_blocks_are_kept_as_the_file_holds_them(tmp_path: Path) -> None:
    shape = Shape("llama", **TINY, num_heads=4, num_kv_heads=2, head_dim=64, context_length=512)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, shape, lambda _layer, _piece: "Q4_K", output_type=None)
    llm = LLM(str(path), tokenizer=str(tmp_path), device="cpu", quantization="gguf")
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(path).tensors}
    layer = llm.runner.model.layers[0]
    down = layer.mlp.down_proj
    assert down.weight is None and torch.equal(down.qweight0, tensors["blk.0.ffn_down.weight"])
    # q and k: llama.cpp's row order undone on whole rows of blocks (head by head, the
    # rows of each RoPE pair's halves brought back together)
    q_file = tensors["blk.0.attn_q.weight"].reshape(4, 32, 2, -1)  # [heads, pairs, 2, bytes]
    q_ours = layer.self_attn.qkv_proj.qweight0[:256].reshape(4, 2, 32, -1)
    assert torch.equal(q_ours, q_file.transpose(1, 2))


def test_a_flag_that_does_not_fit_the_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not apply to a GGUF file"):
        LLM(device="cpu", quantization="awq")
    shape = Shape("llama", **TINY, num_heads=4, num_kv_heads=2, head_dim=64, context_length=512)
    write_gguf(tmp_path / "tiny.gguf", shape, lambda _layer, _piece: "Q8_0")
    with pytest.raises(ValueError, match=r"needs a \.gguf model file"):
        LLM(str(tmp_path / "tiny.gguf"), device="cpu", quantization="gguf", load_format="dummy")


def test_a_fused_projection_missing_a_piece_is_refused() -> None:
    layer = Linear(256, 384, method=GgufBlocks())  # q (256 rows) + k + v (64 each)
    blocks = torch.zeros(256, 144, dtype=torch.uint8)
    layer.method.load_shard(layer, 0, PackedWeight("Q4_K", blocks))
    layer.method.load_shard(layer, 320, PackedWeight("Q4_K", blocks[:64]))
    missing = r"weights missing .* rows from \[0, 320\] to \[256, 384\]"
    with pytest.raises(ValueError, match=missing):
        layer.method.prepare(layer)
