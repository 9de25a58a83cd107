"""The engine loop's contract with its executor, driven with a recording executor.

The real executor (the ModelRunner, in-process, or the executor process behind
RemoteExecutor) is covered by tests/integration and tests/e2e; here the loop itself:
plan k+1 is submitted before step k is collected, and its outputs equal a serial run's.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.engine_core import EngineCore
from shared.protocol import ModelRunnerOutput, ParameterError, RequestOutput, SchedulerOutput
from tests.unit.scheduler_setup import add, make_scheduler


class RecordingExecutor:
    """Keeps per-request lengths as the real executor does, samples `100 + k` for a request's
    k-th output token, and logs every call. A row with draft slots verifies as many drafts,
    of which it accepts 0 to all (by the step and the request's length), as a real one may."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.plans: list[SchedulerOutput] = []
        self._queued: deque[ModelRunnerOutput] = deque()
        self._num_tokens: dict[str, int] = {}  # prompt + outputs, tokens in flight included
        self._num_outputs: dict[str, int] = {}
        self._num_computed: dict[str, int] = {}

    def submit(self, plan: SchedulerOutput) -> None:
        assert len(self._queued) < 2, "more than two steps in flight"
        for new in plan.new_requests:
            self._num_tokens[new.request_id] = len(new.prompt_token_ids + new.output_token_ids)
            self._num_outputs[new.request_id] = len(new.output_token_ids)
            self._num_computed[new.request_id] = new.num_computed_tokens
        for cached in plan.cached_requests:  # a bound where drafts are in flight: never less
            assert cached.num_computed_tokens >= self._num_computed[cached.request_id]
        sampled, num_drafts = {}, {}
        for request_id, num_new in plan.num_scheduled_tokens.items():
            slots = plan.draft_slots.get(request_id, 0)
            self._num_computed[request_id] += num_new - slots
            if self._num_computed[request_id] == self._num_tokens[request_id]:
                num_accepted = (plan.step + self._num_tokens[request_id]) % (slots + 1)
                first = 100 + self._num_outputs[request_id]
                sampled[request_id] = list(range(first, first + 1 + num_accepted))
                self._num_computed[request_id] += num_accepted  # drafts whose KV is kept
                self._num_tokens[request_id] += 1 + num_accepted
                self._num_outputs[request_id] += 1 + num_accepted
                if slots:
                    num_drafts[request_id] = slots
        self._queued.append(
            ModelRunnerOutput(step=plan.step, sampled=sampled, num_drafts=num_drafts)
        )
        self.calls.append(("submit", plan.step))
        self.plans.append(plan)

    def collect(self) -> ModelRunnerOutput:
        output = self._queued.popleft()
        self.calls.append(("collect", output.step))
        return output

    def accepts_addendum(self, step: int) -> bool:
        return False  # it runs each plan as it is submitted

    def amend(self, addendum: SchedulerOutput) -> None:
        raise AssertionError("an addendum to a plan already run")


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


def test_a_speculating_request_runs_pipelined_and_no_empty_plan_is_queued() -> None:
    """A speculating request's rows are pipelined, with room for drafts. Near its end, where
    the steps in flight may bring it to max_tokens already, it waits for them: the core then
    collects a step rather than queue a plan with nothing in it, and queues the request's
    next step before it hands the tokens to its caller."""
    core, executor = make_core(num_speculative_tokens=3)
    add(core.scheduler, "a", [1, 3, 4, 5, 6], max_tokens=8)
    tokens = []
    while core.has_unfinished():
        outputs = core.step()
        core.scheduler.check_invariants()
        tokens += [t for o in outputs for t in o.new_token_ids]
        if outputs and outputs[-1].finish_reason is None:
            in_flight = sum(1 if call == "submit" else -1 for call, _ in executor.calls)
            assert in_flight, "the device waits for the caller"
    assert tokens == list(range(100, 108))
    assert all(plan.num_scheduled_tokens or plan.finished_request_ids for plan in executor.plans)


def test_a_core_that_can_schedule_nothing_says_so() -> None:
    core, _ = make_core(num_blocks=4)
    add(core.scheduler, "a", [1, 3, 4, 5, 6], max_tokens=3)
    core.scheduler.kv.pool.allocate(4)  # every block taken by something the core knows nothing of
    with pytest.raises(RuntimeError, match="could not schedule"):
        core.step()


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    num_blocks=st.integers(6, 24),
    budget=st.integers(4, 48),
    max_num_seqs=st.integers(1, 6),
    chunked=st.booleans(),
    drafts=st.integers(0, 3),
    requests=st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 12), st.booleans()), min_size=1, max_size=10
    ),
)
def test_any_admitted_workload_runs_to_the_end_without_getting_stuck(
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
    chunked: bool,
    drafts: int,
    requests: list[tuple[int, int, bool]],
) -> None:
    """Tight pools and budgets (preemption, chunking, tokens in flight, speculating rows that
    accept any number of their drafts) never trip the loop's "could not schedule" guard, and
    every admitted request ends with its tokens in order, its blocks freed."""
    core, _ = make_core(
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked,
        num_speculative_tokens=drafts,
    )
    admitted = set()
    for i, (prompt_len, max_tokens, shared) in enumerate(requests):
        prompt = [7] * prompt_len if shared else [10 + i] * prompt_len
        try:
            add(core.scheduler, str(i), prompt, max_tokens=max_tokens, ignore_eos=True)
        except ParameterError:
            continue  # can never fit: refused at admission
        admitted.add(str(i))
    outputs = run(core)
    assert {rid for rid, outs in outputs.items() if outs[-1].finish_reason == "length"} == admitted
    for rid in admitted:
        tokens = [t for out in outputs[rid] for t in out.new_token_ids]
        assert tokens == list(range(100, 100 + requests[int(rid)][1]))
    assert core.scheduler.kv.pool.num_referenced == 0
