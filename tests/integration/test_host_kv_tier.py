"""The prefix cache's host tier (`--kv-offloading-size`) end to end on the CPU: conversations
whose histories overflow a small GPU pool come back to their evicted prefixes, restored from
the host tier instead of recomputed, with the tokens an engine without the tier gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams
from services.executor.runner.host_kv import HostKVPool
from services.launcher.cli import main
from shared.config import ConfigError
from shared.protocol import HostCopies
from tests.integration.tp_generate import generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SETTINGS = dict(dtype="float32", device="cpu", max_model_len=256, block_size=16)
# The tiny Llama's block: 2 layers x K, V x 2 heads x 16 dims x 4 bytes x 16 tokens = 8 KiB;
# the tier holds 64 blocks, the GPU pool 20.
TIER_GIB = 64 * 8192 / 2**30
VARIANTS = {
    "one at a time": dict(num_gpu_blocks_override=20),
    "chunked prefill 16": dict(num_gpu_blocks_override=20, max_num_batched_tokens=16),
    "together, preempting": dict(num_gpu_blocks_override=14),
    "fp8 cache": dict(num_gpu_blocks_override=20, kv_cache_dtype="fp8"),
}


def conversations(num: int = 5, turns: int = 3) -> list[list[list[int]]]:
    """Each conversation's turns: its first prompt (~50 tokens), then a few tokens more."""
    generator = torch.Generator().manual_seed(7)

    def draw(n: int) -> list[int]:
        return torch.randint(3, 250, (n,), generator=generator).tolist()

    return [[draw(50)] + [draw(5) for _ in range(turns - 1)] for _ in range(num)]


def chat(llm: LLM, together: bool) -> list[list[int]]:
    """Every conversation turn by turn, each history resent whole: one request at a time, or
    each turn's requests in one batch."""
    chats = conversations()
    histories = [[] for _ in chats]
    outputs = []
    for turn in range(len(chats[0])):
        prompts = [h + c[turn] for h, c in zip(histories, chats, strict=True)]
        if together:
            results = [r.token_ids for r in llm.generate(prompts, GREEDY)]
        else:
            results = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
        histories = [p + r for p, r in zip(prompts, results, strict=True)]
        outputs += results
    return outputs


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_restored_prefixes_give_the_recomputed_tokens(tiny_llama_dir: Path, variant: str) -> None:
    settings = {**SETTINGS, **VARIANTS[variant]}
    together = variant.startswith("together")
    expected = chat(LLM(str(tiny_llama_dir), **settings), together)
    llm = LLM(str(tiny_llama_dir), kv_offloading_size=TIER_GIB, **settings)
    assert chat(llm, together) == expected
    tier = llm.stats().host_tier
    assert tier is not None and tier.num_blocks >= 64  # 128 of an FP8 cache's
    assert tier.blocks_to_host > 0 and tier.blocks_to_gpu > 0 and tier.hits > 0
    llm.engine.scheduler.check_invariants()


def test_it_needs_prefix_caching(tiny_llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"--kv-offloading-size: .*needs prefix caching"):
        LLM(str(tiny_llama_dir), kv_offloading_size=1.0, enable_prefix_caching=False, **SETTINGS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_restored_block_holds_every_layers_kv_as_it_was(dtype: torch.dtype) -> None:
    """The executor's pool (on the GPU where there is one): blocks copied out, overwritten,
    and copied back into other blocks hold what they held, bit for bit, in every layer."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 12, 16, 2, 8, generator=generator).to(device, dtype) for _ in range(3)]
    pool = HostKVPool(caches, num_slots=4)
    before = [cache[:, [3, 7]].clone() for cache in caches]
    pool.copy(HostCopies(offloads=[(3, 2), (7, 0)]), step=1)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))  # the blocks reused
    # an offload and two restores in one plan
    pool.copy(HostCopies(offloads=[(5, 1)], onloads=[(2, 9), (0, 4)]), step=2)
    for cache, held in zip(caches, before, strict=True):
        assert torch.equal(cache[:, [9, 4]], held)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_restored_prefixes_on_a_gpu(tiny_llama_dir: Path) -> None:
    """bf16 under CUDA graphs, the copies on the compute stream between pipelined steps."""
    settings = {**SETTINGS, "device": "cuda", "dtype": "bfloat16", "num_gpu_blocks_override": 20}
    expected = chat(LLM(str(tiny_llama_dir), **settings), together=False)
    llm = LLM(str(tiny_llama_dir), kv_offloading_size=TIER_GIB / 2, **settings)
    assert chat(llm, together=False) == expected
    tier = llm.stats().host_tier
    assert tier is not None and tier.hits > 0


@pytest.mark.parametrize("tier", [False, True])
def test_the_multi_turn_bench_restores_later_turns_from_the_tier(
    tiny_llama_dir: Path, tmp_path: Path, tier: bool
) -> None:
    """`kvflow bench multi-turn` on a pool the histories outgrow: with the tier, later turns
    find their histories there; without it, they recompute them."""
    out = tmp_path / "multi_turn.json"
    argv = ["bench", "multi-turn", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32"]
    argv += ["--conversations", "4", "--turns", "3", "--first-len", "60", "--turn-len", "10"]
    argv += ["--output-len", "4", "--num-gpu-blocks-override", "12", "--max-model-len", "256"]
    argv += ["--output-json", str(out)] + (["--kv-offloading-size", str(TIER_GIB)] if tier else [])
    assert main(argv) == 0
    turns = json.loads(out.read_text())["turns"]
    assert len(turns) == 3 and all(t["ttft_ms_median"] > 0 for t in turns)
    restored = sum(t["host_tier_hit_tokens"] for t in turns[1:])
    assert (restored > 0) == tier


def test_two_ranks_restore_their_own_heads(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """--tensor-parallel-size 2 over gloo: each rank copies its own KV heads out and back; a
    prompt whose prefix was evicted by the ones before it is restored, with the tokens of one
    rank recomputing it."""
    first = conversations(num=4)
    prompts = [c[0] for c in first] + [first[0][0] + first[0][1]]  # the first again, longer
    settings = dict(num_gpu_blocks_override=12, max_num_seqs=1, block_size=16, max_model_len=256)
    expected = generate(tmp_path / "one", 1, str(tiny_llama_dir), prompts, 6, **settings)
    got = generate(
        tmp_path / "two", 2, str(tiny_llama_dir), prompts, 6, kv_offloading_size=TIER_GIB,
        **settings,
    )  # fmt: skip
    assert got == expected
    assert json.loads((tmp_path / "two" / "host_tier.json").read_text())["hits"] > 0
