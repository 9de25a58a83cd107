"""Admission control and the scheduling policies: the waiting queue's exact bounds, and the
order of `priority` scheduling (vLLM's semantics: lower value first, then arrival; the lowest
priority is preempted first)."""

from __future__ import annotations

import pytest

from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from shared.protocol import EngineRequest, ParameterError, QueueFullError, SamplingParams
from tests.unit.scheduler_setup import add, make_scheduler
from tests.unit.test_scheduler import prompt_of, run_step


def waiting_ids(scheduler: Scheduler) -> list[str]:
    return [r.request_id for r in scheduler.waiting]


def test_the_token_bound_counts_waiting_prompt_tokens_exactly() -> None:
    scheduler = make_scheduler(max_queued_tokens=10, max_num_seqs=1)
    add(scheduler, "a", prompt_of(6))
    with pytest.raises(QueueFullError, match="6 prompt tokens are waiting"):
        add(scheduler, "b", prompt_of(5))  # 11 > 10
    add(scheduler, "b", prompt_of(4))  # exactly 10
    assert scheduler.stats().num_waiting_tokens == 10
    assert scheduler.stats().queue_full == ("10 prompt tokens are waiting (--max-queued-tokens)")
    run_step(scheduler)  # a runs (max_num_seqs=1): its tokens leave the count
    assert scheduler.stats().num_waiting_tokens == 4
    add(scheduler, "c", prompt_of(6))
    scheduler.check_invariants()


def test_an_empty_queue_takes_a_prompt_longer_than_the_token_bound() -> None:
    scheduler = make_scheduler(max_queued_tokens=4)
    add(scheduler, "long", prompt_of(20))
    with pytest.raises(QueueFullError):
        add(scheduler, "short", prompt_of(1))


def test_aborting_a_waiting_request_gives_its_room_back() -> None:
    scheduler = make_scheduler(max_queued_requests=1, max_queued_tokens=8)
    add(scheduler, "a", prompt_of(8))
    with pytest.raises(QueueFullError, match="--max-queued-requests 1"):
        add(scheduler, "b", prompt_of(2))
    scheduler.abort(["a"])
    add(scheduler, "b", prompt_of(8))
    assert scheduler.stats().num_waiting_tokens == 8


def test_preempted_requests_go_back_whatever_the_bounds() -> None:
    # Two decodes fill the pool and a third request waits; preemption requeues past the bound.
    scheduler = make_scheduler(num_blocks=4, max_model_len=64, max_queued_requests=2)
    add(scheduler, "a", prompt_of(6), max_tokens=6)
    add(scheduler, "b", prompt_of(6, 40), max_tokens=6)
    for _ in range(3):
        run_step(scheduler)
    add(scheduler, "c", prompt_of(4, 80))
    add(scheduler, "d", prompt_of(4, 120))  # the queue is now full
    run_step(scheduler)  # a needs a block: b is preempted into the full queue
    assert waiting_ids(scheduler) == ["b", "c", "d"]
    assert scheduler.stats().num_waiting_tokens == 4 + 4 + 6 + 3  # c, d; b's prompt + outputs
    with pytest.raises(QueueFullError):
        add(scheduler, "e", prompt_of(1))
    scheduler.check_invariants()


def test_fcfs_refuses_a_priority() -> None:
    scheduler = make_scheduler()
    with pytest.raises(ParameterError) as refused:
        scheduler.add_request(_request("a", priority=1))
    assert refused.value.param == "priority"
    scheduler.add_request(_request("a", priority=0))


def test_priority_orders_waiting_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
    for request_id, priority, arrival in [
        ("a", 1, 1.0),
        ("b", 0, 2.0),
        ("c", 1, 0.5),
        ("d", -1, 3.0),
    ]:
        scheduler.add_request(_request(request_id, priority, arrival))
    assert waiting_ids(scheduler) == ["d", "b", "c", "a"]
    plan, _ = run_step(scheduler)
    assert list(plan.num_scheduled_tokens) == ["d"]
    scheduler.check_invariants()


def test_priority_preempts_the_lowest_priority_not_the_last_admitted() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=64, scheduling_policy="priority")
    scheduler.add_request(_request("low", priority=5, arrival=1.0, length=6))
    scheduler.add_request(_request("high", priority=0, arrival=2.0, length=6))
    for _ in range(3):
        run_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["high", "low"]
    plan, _ = run_step(scheduler)  # one of them needs a 5th block: "low" gives its up
    assert scheduler.requests["low"].status is RequestStatus.WAITING
    assert "low" in plan.finished_request_ids and "high" in plan.num_scheduled_tokens
    scheduler.check_invariants()


def _request(
    request_id: str, priority: int = 0, arrival: float = 0.0, length: int = 4
) -> EngineRequest:
    """A request whose prompt shares no block with the others' (no prefix hits)."""
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt_of(length, start=100 * (1 + sum(map(ord, request_id)) % 50)),
        sampling_params=SamplingParams(max_tokens=6),
        arrival_time=arrival,
        priority=priority,
    )
