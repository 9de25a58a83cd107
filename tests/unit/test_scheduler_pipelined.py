"""The scheduler driven as the pipelined engine drives it: step k+1 is scheduled before step
k's tokens are reported, so decodes run on tokens still in flight."""

from __future__ import annotations

from services.scheduler.scheduler import Scheduler
from shared.protocol import FinishReason, ModelRunnerOutput, RequestOutput, SchedulerOutput
from tests.unit.scheduler_setup import EOS, add, make_scheduler


def schedule(scheduler: Scheduler) -> tuple[SchedulerOutput, set[str]]:
    """A plan, and the requests it samples (those whose pending count it raised)."""
    before = {rid: r.num_pending_tokens for rid, r in scheduler.requests.items()}
    plan = scheduler.schedule()
    scheduler.check_invariants()
    sampling = {
        rid
        for rid in plan.num_scheduled_tokens
        if scheduler.requests[rid].num_pending_tokens > before.get(rid, 0)
    }
    return plan, sampling


def report(
    scheduler: Scheduler, plan: SchedulerOutput, sampling: set[str], token_id: int
) -> list[RequestOutput]:
    result = ModelRunnerOutput(step=plan.step, sampled=dict.fromkeys(sampling, token_id))
    outputs = scheduler.update(plan, result)
    scheduler.check_invariants()
    return outputs


def test_decode_is_scheduled_on_a_token_in_flight_and_stops_at_max_tokens() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", [1, 3, 4, 5, 6], max_tokens=3)
    first, first_samples = schedule(scheduler)
    second, second_samples = schedule(scheduler)  # before the first token is known
    assert first.num_scheduled_tokens == {"a": 5} and first_samples == {"a"}
    assert second.num_scheduled_tokens == {"a": 1} and second_samples == {"a"}
    report(scheduler, first, first_samples, 100)
    third, third_samples = schedule(scheduler)
    assert third.num_scheduled_tokens == {"a": 1}
    report(scheduler, second, second_samples, 101)
    fourth, _ = schedule(scheduler)
    assert not fourth.num_scheduled_tokens  # the third token, in flight, is the last
    (last,) = report(scheduler, third, third_samples, 102)
    assert last.finish_reason is FinishReason.LENGTH
    assert scheduler.requests == {} and scheduler.kv.pool.num_referenced == 0


def test_a_stop_token_found_late_discards_the_step_in_flight() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", [1, 3, 4, 5, 6], max_tokens=10)
    first, first_samples = schedule(scheduler)
    second, second_samples = schedule(scheduler)
    (stopped,) = report(scheduler, first, first_samples, EOS)
    assert stopped.finish_reason is FinishReason.STOP and stopped.new_token_ids == [EOS]
    assert report(scheduler, second, second_samples, 7) == []  # computed, then dropped
    third, _ = schedule(scheduler)
    assert third.finished_request_ids == ["a"]  # the executor forgets it
    assert scheduler.kv.pool.num_referenced == 0


def test_preempted_with_its_last_token_in_flight_leaves_the_waiting_queue() -> None:
    # Two one-block prompts fill the pool; each decode then needs a second block.
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    add(scheduler, "a", [1, 3, 4, 5], max_tokens=4)
    add(scheduler, "b", [1, 3, 4, 6], max_tokens=1)
    first, first_samples = schedule(scheduler)
    assert first_samples == {"a", "b"}
    second, second_samples = schedule(scheduler)  # preempts b, the last admitted
    assert scheduler.num_preemptions == 1 and "b" not in second.num_scheduled_tokens
    outputs = report(scheduler, first, first_samples, 100)
    finished = {out.request_id: out.finish_reason for out in outputs}
    assert finished == {"a": None, "b": FinishReason.LENGTH}
    assert not scheduler.waiting and "b" not in scheduler.requests
    report(scheduler, second, second_samples, 101)
    assert scheduler.requests["a"].output_token_ids == [100, 101]
