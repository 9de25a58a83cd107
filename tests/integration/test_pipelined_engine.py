"""The pipelined engine gives exactly what one step at a time gives.

The engine queues step k+1 before it waits for step k, so decodes run on input tokens that
only the device knows yet (gathered from the last sampled ids), and a request with penalties
makes the executor wait for the tokens in flight first. Neither may change a single token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from services.executor.runner.model_runner import ModelRunner
from services.scheduler.engine_core import EngineCore
from shared.protocol import EngineRequest, ModelRunnerOutput, RequestOutput, SchedulerOutput

PROMPTS = [[5, 9, 11, 40], [7] * 20, list(range(3, 40)), [3, 1, 4, 1, 5, 9, 2, 6]]
MIXED = [
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=9, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.0, seed=5, min_tokens=4, max_tokens=12, frequency_penalty=0.5),
]


def add_all(engine: EngineCore, params: list[SamplingParams]) -> None:
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(
            EngineRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=p)
        )


def collect(outputs: list[RequestOutput], tokens: dict[str, list], logprobs: dict) -> None:
    for out in outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)


def run_one_step_at_a_time(engine: EngineCore, runner: ModelRunner) -> tuple[dict, dict]:
    tokens: dict[str, list] = {}
    logprobs: dict[str, list] = {}
    while engine.has_unfinished():
        plan = engine.scheduler.schedule()
        collect(engine.scheduler.update(plan, runner.execute(plan)), tokens, logprobs)
    return tokens, logprobs


def run_pipelined(engine: EngineCore, runner: ModelRunner) -> tuple[dict, dict, int]:
    """Outputs, and how many decode inputs the device had to fill in itself."""
    tokens: dict[str, list] = {}
    logprobs: dict[str, list] = {}
    buffers = runner.buffers
    num_gathered = 0
    while engine.has_unfinished():
        collect(engine.step(), tokens, logprobs)
        num_tokens = buffers.last_step[0]
        start = buffers.offsets["source_rows"]
        num_gathered += int(np.sum(buffers.np[start : start + num_tokens] >= 0))
    engine.scheduler.check_invariants()
    return tokens, logprobs, num_gathered


def test_pipelined_steps_equal_serial_steps(tiny_llama_dir: Path) -> None:
    serial = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128)
    pipelined = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128)
    for params in ([p for p in MIXED[:1] for _ in PROMPTS], MIXED):
        add_all(serial.engine, params)
        add_all(pipelined.engine, params)
        expected_tokens, expected_logprobs = run_one_step_at_a_time(serial.engine, serial.runner)
        tokens, logprobs, num_gathered = run_pipelined(pipelined.engine, pipelined.runner)
        assert tokens == expected_tokens
        assert logprobs == expected_logprobs
        assert [len(tokens[str(i)]) for i in range(len(PROMPTS))] == [p.max_tokens for p in params]
        # Decodes did run on tokens still in flight (in the mixed round, once the requests
        # with penalties, which wait for them, are done).
        assert num_gathered > 0


class HeldRunner:
    """The executor process's contract, in-process: a plan is held (prepared, not launched)
    until the next plan is submitted or its answer is due, and takes addenda meanwhile."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.held: int | None = None
        self.num_addenda = 0

    def submit(self, plan: SchedulerOutput) -> None:
        self._launch_held()
        self.runner.prepare(plan)
        self.held = plan.step

    def accepts_addendum(self, step: int) -> bool:
        return self.runner.accepts_addendum(step)

    def amend(self, addendum: SchedulerOutput) -> None:
        self.runner.amend(addendum)
        self.num_addenda += 1

    def collect(self) -> ModelRunnerOutput:
        if not self.runner.num_in_flight:
            self._launch_held()
        return self.runner.collect()

    def _launch_held(self) -> None:
        if self.held is not None:
            self.runner.launch(self.held)
            self.held = None


def run_with_arrivals(engine: EngineCore, arrivals: list[list[int]]) -> tuple[dict, dict, dict]:
    """Add request i before step `arrivals`'s index holding i, amending the held plan.

    Returns the tokens, logprobs, and the number of steps each request waited for its first
    token after it arrived."""
    tokens: dict[str, list] = {}
    logprobs: dict[str, list] = {}
    arrived_at: dict[str, int] = {}
    steps_to_first: dict[str, int] = {}
    step = 0
    while step < len(arrivals) or engine.has_unfinished():
        for index in arrivals[step] if step < len(arrivals) else []:
            engine.add_request(
                EngineRequest(
                    request_id=str(index),
                    prompt_token_ids=PROMPTS[index],
                    sampling_params=MIXED[index],
                )
            )
            arrived_at[str(index)] = step
        engine.amend()
        outputs = engine.step()
        step += 1
        for out in outputs:
            if out.new_token_ids and out.request_id not in steps_to_first:
                steps_to_first[out.request_id] = step - arrived_at[out.request_id]
        collect(outputs, tokens, logprobs)
        engine.scheduler.check_invariants()
    return tokens, logprobs, steps_to_first


ON_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_requests_that_join_a_held_plan_get_the_same_tokens_one_step_sooner(
    tiny_llama_dir: Path, device: str
) -> None:
    # Penalties, seeded sampling and logprobs included: an addendum changes a step's batch,
    # never a request's tokens. On a GPU it turns a decode graph's step into a mixed one.
    arrivals = [[0], [], [1], [2, 3]]
    settings = dict(dtype="float32", device=device, max_model_len=128)
    if device == "cuda":
        settings["kv_cache_memory_bytes"] = 64 << 20
    plain = LLM(str(tiny_llama_dir), **settings)
    expected_tokens, expected_logprobs, plain_steps = run_with_arrivals(plain.engine, arrivals)
    held = LLM(str(tiny_llama_dir), **settings)
    executor = HeldRunner(held.runner)
    engine = EngineCore(held.engine.scheduler, executor)
    tokens, logprobs, held_steps = run_with_arrivals(engine, arrivals)
    assert tokens == expected_tokens
    # Batches differ, so a GPU's GEMMs may round differently: logprobs agree to 1e-4.
    assert logprobs.keys() == expected_logprobs.keys()
    for request_id, expected in expected_logprobs.items():
        got = logprobs[request_id]
        assert [lp.token_id for lp in got] == [lp.token_id for lp in expected]
        expected_values = [lp.logprob for lp in expected]
        assert [lp.logprob for lp in got] == pytest.approx(expected_values, abs=1e-4)
    assert executor.num_addenda == 2  # requests 1 and 2+3 joined held plans
    late = ["1", "2", "3"]
    assert [held_steps[r] for r in late] == [plain_steps[r] - 1 for r in late]
