"""The pipelined engine gives exactly what one step at a time gives.

The engine queues step k+1 before it waits for step k, so decodes run on input tokens that
only the device knows yet (gathered from the last sampled ids), and a request with penalties
makes the executor wait for the tokens in flight first. Neither may change a single token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvflow import LLM, SamplingParams
from services.executor.model_runner import ModelRunner
from services.scheduler.engine_core import EngineCore
from shared.protocol import EngineRequest, RequestOutput

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
