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
from services.executor.parallel.replica_experts import StepRows
from services.executor.runner.cuda_graphs import StepGraphs
from services.executor.runner.step_buffers import PaddedShape, StepBuffers, StepView
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_graph_masks_the_padding_its_replay_has_not_its_captures() -> None:
    """Across replicas (services/executor/runner/replica_rounds.py), each replay masks the rows
    the replicas' rows of its step leave over: the mask is made in the graph, from the rows on
    the device, though the warm-up before the capture made one with every row a replica's
    (a graph that kept that one would replay a freed tensor's bytes)."""
    device = torch.device("cuda")
    step = StepRows()
    step.keep_on_device(2, device)

    def forward(view: StepView) -> torch.Tensor:  # two replicas' gathered rows: -1, padding
        rows = torch.arange(2 * view.input_ids.shape[0], device=device)
        padding = step.padding(device)
        return rows if padding is None else rows.masked_fill(padding.reshape(-1), -1)

    buffers = StepBuffers(64, 8, 4, 16, device)
    graphs = StepGraphs(
        forward, buffers, max_batch=8, max_seq_len=16, mixed=False,
        before_capture=lambda shape: step.set([shape.num_tokens] * 2),
    )  # fmt: skip
    graphs.capture()
    shape = graphs.shape_at(4, 1)
    assert shape is not None
    for rows, expected in (([1, 3], [0, -1, -1, -1, 4, 5, 6, -1]), ([4, 2], [*range(6), -1, -1])):
        step.set(rows, padded_to=4)
        torch.empty(4096, device=device).fill_(1.0)  # what a freed mask's memory may hold
        assert graphs.replay(shape).tolist() == expected
