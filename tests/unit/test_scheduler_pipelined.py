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
    result = ModelRunnerOutput(step=plan.step, sampled={rid: [token_id] for rid in sampling})
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


def test_an_addendum_admits_new_requests_into_the_held_plan_within_its_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=3)
    add(scheduler, "a", [1, 3, 4, 5, 6], max_tokens=5)
    first, first_samples = schedule(scheduler)
    held, _ = schedule(scheduler)  # a's decode, on the token in flight
    assert scheduler.schedule_addendum(held) is None  # nobody waits
    add(scheduler, "b", list(range(3, 9)))  # 6 tokens: fits the 15 left
    add(scheduler, "c", list(range(30, 47)))  # 17 tokens: 9 of them fit
    add(scheduler, "d", [7, 8])  # no room left: a whole plan later
    addendum = scheduler.schedule_addendum(held)
    scheduler.check_invariants()
    assert addendum is not None and addendum.addendum and addendum.step == held.step
    assert addendum.num_scheduled_tokens == {"b": 6, "c": 9}
    assert [n.request_id for n in addendum.new_requests] == ["b", "c"]
    assert not addendum.cached_requests and not addendum.finished_request_ids
    # Merged into the held plan, which the scheduler reports tokens against.
    assert held.num_scheduled_tokens == {"a": 1, "b": 6, "c": 9}
    assert [r.request_id for r in scheduler.waiting] == ["d"]
    assert scheduler.requests["b"].num_pending_tokens == 1  # its prompt is done: it samples
    assert scheduler.requests["c"].num_pending_tokens == 0  # a chunk samples nothing
    report(scheduler, first, first_samples, 100)
    (a_out, b_out) = report(scheduler, held, {"a", "b"}, 101)
    assert (a_out.request_id, b_out.request_id) == ("a", "b")
    nxt, _ = schedule(scheduler)
    assert nxt.num_scheduled_tokens == {"a": 1, "b": 1, "c": 8}


def test_an_addendum_leaves_a_preempted_request_to_a_whole_plan() -> None:
    # Two blocks of 4 tokens: b's growth preempts a, which must not rejoin the held plan,
    # whose executor would drop its state at the next plan (finished_request_ids).
    scheduler = make_scheduler(num_blocks=3, max_num_batched_tokens=32)
    add(scheduler, "a", [1, 3, 4, 5], max_tokens=8)
    add(scheduler, "b", [6, 7, 8, 9], max_tokens=8)
    first, first_samples = schedule(scheduler)
    report(scheduler, first, first_samples, 100)
    held, _ = schedule(scheduler)
    assert scheduler.num_preemptions == 1 and scheduler.waiting.peek().request_id == "b"
    assert scheduler.schedule_addendum(held) is None
    add(scheduler, "c", [5, 5])
    assert scheduler.schedule_addendum(held) is None  # FIFO: c waits behind b


def test_an_addendum_never_makes_a_plan_wider_than_max_num_seqs() -> None:
    """A request that finishes while the next plan is held still has its (wasted) row in that
    plan: a request admitted into it must count that row, or the plan outgrows the executor's
    max_num_seqs rows. (Found by tests/e2e/test_reliability.py: the executor crashed.)"""
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, "a", [1, 3, 4, 5], max_tokens=8)
    first, first_samples = schedule(scheduler)
    held, _ = schedule(scheduler)  # a's decode, on its token in flight
    add(scheduler, "b", [6, 7, 8, 9])
    (finished,) = report(scheduler, first, first_samples, EOS)
    assert finished.finish_reason is FinishReason.STOP  # a is done; its row in `held` stays
    assert scheduler.schedule_addendum(held) is None
    assert list(held.num_scheduled_tokens) == ["a"]
    following, _ = schedule(scheduler)
    assert "b" in following.num_scheduled_tokens


def test_no_request_joins_a_held_plan_with_a_row_of_an_ended_request() -> None:
    """A request that ends while the next plan is held frees its blocks, but its row in that
    plan still writes KV into them: a request admitted into the same step could be given
    them and have its KV overwritten. It waits for the next plan."""
    scheduler = make_scheduler(num_blocks=3)
    add(scheduler, "a", [1, 3, 4, 5], max_tokens=4)
    first, _ = schedule(scheduler)
    held, _ = schedule(scheduler)  # a's decode, in the block it was given for its 5th token
    scheduler.abort(["a"])
    add(scheduler, "b", [6, 7, 8, 9, 10])  # two blocks: the pool's three are free
    assert scheduler.schedule_addendum(held) is None
    assert list(held.num_scheduled_tokens) == ["a"]
    scheduler.update(first, ModelRunnerOutput(step=first.step, sampled={"a": [100]}))
    scheduler.update(held, ModelRunnerOutput(step=held.step, sampled={"a": [101]}))
    following, _ = schedule(scheduler)
    assert "b" in following.num_scheduled_tokens
