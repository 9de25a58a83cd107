"""The engine loop's contract with its executor, driven with a recording executor.

The real executor (the ModelRunner, in-process, or the executor process behind
RemoteExecutor) is covered by tests/integration and tests/e2e; here the loop itself:
plan k+1 is submitted before step k is collected, and its outputs equal a serial run's.
"""

from __future__ import annotations

from collections import deque

import pytest

from services.scheduler.engine_core import EngineCore
from shared.protocol import ModelRunnerOutput, RequestOutput, SchedulerOutput
from tests.unit.scheduler_setup import add, make_scheduler


class RecordingExecutor:
    """Keeps per-request lengths as the real executor does, samples `100 + k` for a request's
    k-th output token, and logs every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.plans: list[SchedulerOutput] = []
        self._queued: deque[ModelRunnerOutput] = deque()
        self._num_tokens: dict[str, int] = {}  # prompt + outputs, tokens in flight included
        self._num_outputs: dict[str, int] = {}

    def submit(self, plan: SchedulerOutput) -> None:
        assert len(self._queued) < 2, "more than two steps in flight"
        for new in plan.new_requests:
            self._num_tokens[new.request_id] = len(new.prompt_token_ids + new.output_token_ids)
            self._num_outputs[new.request_id] = len(new.output_token_ids)
        num_computed = {c.request_id: c.num_computed_tokens for c in plan.cached_requests}
        num_computed |= {n.request_id: n.num_computed_tokens for n in plan.new_requests}
        sampled = {}
        for request_id, num_new in plan.num_scheduled_tokens.items():
            if num_computed[request_id] + num_new == self._num_tokens[request_id]:
                sampled[request_id] = 100 + self._num_outputs[request_id]
                self._num_tokens[request_id] += 1
                self._num_outputs[request_id] += 1
        self._queued.append(ModelRunnerOutput(step=plan.step, sampled=sampled))
        self.calls.append(("submit", plan.step))
        self.plans.append(plan)

    def collect(self) -> ModelRunnerOutput:
        output = self._queued.popleft()
        self.calls.append(("collect", output.step))
        return output


def make_core(**overrides: object) -> tuple[EngineCore, RecordingExecutor]:
    executor = RecordingExecutor()
    return EngineCore(make_scheduler(**overrides), executor), executor


def run(core: EngineCore) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while core.has_unfinished():
        for output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
        core.scheduler.check_invariants()
    return outputs


def test_the_next_plan_is_submitted_before_the_last_is_collected() -> None:
    core, executor = make_core()
    add(core.scheduler, "a", [1, 3, 4, 5, 6], max_tokens=3)
    add(core.scheduler, "b", [7, 8], max_tokens=2)
    outputs = run(core)
    assert executor.calls[:5] == [
        ("submit", 1),
        ("submit", 2),
        ("collect", 1),
        ("submit", 3),
        ("collect", 2),
    ]
    tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}
    assert tokens == {"a": [100, 101, 102], "b": [100, 101]}
    assert [o.finish_reason for o in outputs["a"]][-1] == "length"
    assert core.scheduler.kv.pool.num_referenced == 0


def test_an_idle_core_submits_nothing() -> None:
    core, executor = make_core()
    assert core.step() == []
    assert executor.calls == []


def test_an_abort_reaches_the_executor_even_when_nothing_else_runs() -> None:
    core, executor = make_core()
    add(core.scheduler, "a", [1, 3, 4, 5, 6], max_tokens=8)
    core.step()
    core.step()
    [aborted] = core.abort(["a"])
    assert aborted.finish_reason == "abort"
    assert core.step() == []  # collects the step in flight; its token is discarded
    assert executor.plans[-1].finished_request_ids == ["a"]
    assert not executor.plans[-1].num_scheduled_tokens


def test_a_core_that_can_schedule_nothing_says_so() -> None:
    core, _ = make_core(num_blocks=4)
    add(core.scheduler, "a", [1, 3, 4, 5, 6], max_tokens=3)
    core.scheduler.kv.pool.allocate(4)  # every block taken by something the core knows nothing of
    with pytest.raises(RuntimeError, match="could not schedule"):
        core.step()
