"""On a GPU, Triton compiles nothing inside serving-like steps once the engine has warmed up,
and `kernels.triton_compile_watch` records a variant compiled outside a warm-up (and none
inside one). A variant the warm-up misses is compiled inside a step: on a fresh machine every
running request waits for it (docs/architecture.md, the warm-up)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tests.integration.test_eagle3 import write_head
from tests.integration.tiny_models import FAMILIES, TINY

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_watch_records_compiles_outside_a_warm_up() -> None:
    import triton
    import triton.language as tl

    from kernels.triton_compile_watch import late_compiles

    @triton.jit
    def _fill(out_ptr, VALUE: tl.constexpr):  # type: ignore[no-untyped-def]
        tl.store(out_ptr, VALUE)

    watch = late_compiles()
    out = torch.zeros(1, device="cuda")
    before = len(watch.variants)
    with watch.warming_up():
        _fill[(1,)](out, VALUE=1)
    assert len(watch.variants) == before
    _fill[(1,)](out, VALUE=2)
    _fill[(1,)](out, VALUE=2)  # met before: no compile
    assert len(watch.variants) == before + 1 and "_fill" in watch.variants[-1]
    assert out.item() == 2


# Run in a process of its own: Triton's kernel cache is per process, so a variant an earlier
# test in this one compiled would never reach the watch. The KV cache gets a byte budget, not
# a share of the GPU: memory the test process still holds from earlier tests counts against a
# share (a run of the GPU tests in another order left the child none).
_SERVING_STEPS = """
import json, random, sys
from kernels.triton_compile_watch import late_compiles
from kvflow import LLM, SamplingParams

vocab = int(sys.argv[2])
llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=1024, max_num_batched_tokens=640,
          max_num_seqs=48, kv_cache_memory_bytes=512 << 20,
          speculative_config=json.loads(sys.argv[3]))
rng = random.Random(0)
prompts = [[rng.randrange(vocab) for _ in range(rng.choice([1, 5, 16, 33, 200, 700]))]
           for _ in range(120)]
params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), top_p=rng.choice([1.0, 0.9]),
                         logprobs=rng.choice([None, 2]), max_tokens=rng.randrange(1, 40),
                         ignore_eos=True) for _ in prompts]
results = llm.generate(prompts, params)
lengths_ok = [len(r.outputs[0].token_ids) for r in results] == [p.max_tokens for p in params]
print(json.dumps({"lengths_ok": lengths_ok, "late": late_compiles().variants}))
"""


@pytest.mark.parametrize(
    "speculative",
    [
        None,
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "draft_model", "model": "SELF", "num_speculative_tokens": 4},
        {"method": "eagle3", "model": "HEAD", "num_speculative_tokens": 3},
    ],
)
def test_serving_steps_compile_nothing_after_the_warm_up(
    tmp_path: Path, speculative: dict | None
) -> None:
    """Prompts of 1 to 700 tokens in waves past --max-num-seqs, chunked beside running decodes,
    greedy and sampled, with and without logprobs: decode graphs, mixed graphs and eager steps
    of many sizes, in a fresh process; with speculative decoding, verifying rows too. The
    vocabulary is a real model's size: the lm_head's tiles are those of a wide N."""
    config_cls, extra = FAMILIES["qwen3"]
    torch.manual_seed(0)
    vocab_size = 32768
    # Eight layers: an EAGLE-3 head reads three of them.
    config = config_cls(
        **{**TINY, **extra, "max_position_embeddings": 1024, "vocab_size": vocab_size}
        | {"num_hidden_layers": 8}
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    if speculative is not None and speculative.get("model") == "SELF":
        speculative = {**speculative, "model": str(tmp_path)}  # the model drafts for itself
    if speculative is not None and speculative.get("model") == "HEAD":
        head = write_head(tmp_path / "head", config, list(range(0, vocab_size, 64)))
        speculative = {**speculative, "model": str(head)}
    script = [_SERVING_STEPS, str(tmp_path), str(vocab_size), json.dumps(speculative)]
    done = subprocess.run(
        [sys.executable, "-c", *script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["lengths_ok"]
    assert report["late"] == [], "\n".join(variant[-700:] for variant in report["late"])
