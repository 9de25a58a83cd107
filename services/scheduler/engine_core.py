"""The engine loop: the scheduler and an executor, pipelined.

There is one loop for both paths. Offline, `kvflow.LLM` drives it with the executor's
`ModelRunner` in its own process; when serving, the scheduler process drives it with a
`RemoteExecutor` that carries plans and tokens over ZeroMQ to the executor process.

Plan k+1 is scheduled and queued on the executor before the loop waits for step k's tokens
(the executor reads the decodes' input tokens of step k+1 from step k's on the device), so
the device does not wait while the host schedules, digests outputs and does its caller's work:

    host:    schedule k+1 ─ submit k+1 ─ collect k ─ update k ─ schedule k+2 ─ submit k+2 ─ ...
    device:  ── step k ─────────────────┴── step k+1 ──────────────────────────┴── step k+2

A plan with nothing to run or forget is not queued: the loop collects step k instead (a
request whose tokens in flight may already reach its max_tokens waits so for them), then plans
and queues the steps that waited before its caller reads step k's tokens, so the device runs
the next step while the host digests the last. A speculating request's rows are pipelined too,
with room for drafts that the executor proposes when it lays them out (runner/drafting.py).

A request that arrives while step k runs would so wait for k+2, one whole step more than
without pipelining. Where the executor launches a plan only when told (the executor process:
see DeviceReady), `amend` appends such requests to plan k+1 while it is still held.
"""

from __future__ import annotations

from typing import Protocol

from services.scheduler.scheduler import Scheduler
from shared.protocol import (
    EngineRequest,
    ModelRunnerOutput,
    RequestOutput,
    SchedulerOutput,
    StatsSnapshot,
)


def runs(plan: SchedulerOutput) -> bool:
    """Whether the plan has work for the executor: rows to compute, or copies between the
    KV tiers."""
    return bool(plan.num_scheduled_tokens) or plan.host_copies is not None


class Executor(Protocol):
    """Runs plans in order. `submit` queues one and returns; `collect` waits for the oldest
    plan submitted and not yet collected. At most two are in flight."""

    def submit(self, plan: SchedulerOutput) -> None: ...

    def collect(self) -> ModelRunnerOutput: ...

    def accepts_addendum(self, step: int) -> bool:
        """Whether plan `step` is submitted and not launched yet, so rows can still join it."""
        ...

    def amend(self, addendum: SchedulerOutput) -> None: ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self._in_flight: SchedulerOutput | None = None  # submitted, not yet collected

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises ParameterError or QueueFullError if it is refused."""
        self.scheduler.add_request(request)

    def amend(self) -> None:
        """Admit waiting requests into the plan in flight, if the executor still holds it."""
        plan = self._in_flight
        if plan is None or not self.scheduler.waiting:
            return
        if not self.executor.accepts_addendum(plan.step):
            return
        addendum = self.scheduler.schedule_addendum(plan)
        if addendum is not None:
            self.executor.amend(addendum)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        return self.scheduler.abort(request_ids)

    def forget_in_flight(self) -> None:
        """The executor dropped every step (it was reset): none is in flight any more, nor
        any disk read."""
        self._in_flight = None
        self.scheduler.kv.abandon_disk_reads()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> StatsSnapshot:
        return self.scheduler.stats()

    def step(self) -> list[RequestOutput]:
        """Submit the next plan, then collect the one before it: what its requests got."""
        plan = self.scheduler.schedule()
        in_flight = self._in_flight
        if not runs(plan) and (in_flight is None or not runs(in_flight)):
            if in_flight is None and self.scheduler.kv.reads_out():
                # Requests wait for disk reads and nothing else runs: a step with no rows,
                # whose report waits (a little) for them (services/executor/runner/disk_kv.py)
                self.executor.submit(plan)
                self._in_flight = plan
                return []
            # NOTE: nothing runs and nothing is in flight, so no later step sees anything new:
            # unfinished requests would wait forever (a bug: admission guarantees each fits).
            if self.scheduler.has_unfinished() and not self.scheduler.kv.reads_out():
                raise RuntimeError("the scheduler could not schedule any unfinished request")
            if in_flight is None and not plan.finished_request_ids:
                return []  # nothing to run, to wait for, or for the executor to forget
        if not runs(plan) and not plan.finished_request_ids and in_flight:
            # Nothing to run or forget (requests wait for the tokens in flight): wait for
            # that step rather than queue an empty one behind it, then launch the requests
            # that waited for its tokens before the caller reads them.
            # NOTE: if that submit raises, `outputs` are lost with it, as an uncollected step's
            # tokens are on the pipelined path: the scheduler process then fails every
            # request (_fail_all).
            self._in_flight = None
            outputs = self.scheduler.update(in_flight, self.executor.collect())
            self._submit_if_any(self.scheduler.schedule())
            return outputs
        self.executor.submit(plan)
        self._in_flight = plan
        if in_flight is None:
            return []
        return self.scheduler.update(in_flight, self.executor.collect())

    def _submit_if_any(self, plan: SchedulerOutput) -> None:
        """Queue `plan` unless it has nothing to run or forget (then it is dropped)."""
        if runs(plan) or plan.finished_request_ids:
            self.executor.submit(plan)
            self._in_flight = plan
