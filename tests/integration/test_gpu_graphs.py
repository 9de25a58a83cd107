"""On a GPU, the CUDA graphs (decode batches and padded mixed steps) compute what the eager
forward pass computes: same greedy tokens, logprobs equal to float32 rounding.

A small token budget admits the prompts a chunk at a time beside running decodes, so the run
has prompt-only, mixed and decode-only steps; the test checks that mixed graphs replayed.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from kvflow import LLM, SamplingParams
from services.executor.runner.step_buffers import PaddedShape
from tests.integration.tiny_models import FAMILIES, TINY, make_prompts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphs_match_eager(tmp_path: object) -> None:
    config_cls, extra = FAMILIES["qwen3"]
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **extra})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    prompts = make_prompts(TINY["vocab_size"], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True)
    runs = {}
    replayed: list[PaddedShape] = []
    for eager in (True, False):
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            enforce_eager=eager,
            max_num_batched_tokens=48,
            max_model_len=256,
            gpu_memory_utilization=0.2,
        )
        if not eager:
            graphs = llm.runner.graphs
            assert graphs is not None
            replay = graphs.replay

            def spy(shape: PaddedShape, replay=replay) -> torch.Tensor:
                replayed.append(shape)
                return replay(shape)

            graphs.replay = spy  # type: ignore[method-assign]
        runs[eager] = llm.generate(prompts, params)
        del llm
        torch.cuda.empty_cache()
    assert any(not s.decode for s in replayed) and any(s.decode for s in replayed)
    for eager_result, graph_result in zip(runs[True], runs[False], strict=True):
        eager_out, graph_out = eager_result.outputs[0], graph_result.outputs[0]
        assert graph_out.token_ids == eager_out.token_ids
        for a, b in zip(eager_out.logprobs, graph_out.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
