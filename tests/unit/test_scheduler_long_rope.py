"""LongRoPE in the scheduler: a request longer than the original context is computed with
the long set from its start; one that grows past it while running is computed again from its
start with the long set, once; its blocks are keyed apart from the short set's."""

from __future__ import annotations

from services.scheduler.scheduler import Scheduler
from shared.protocol import SchedulerOutput
from tests.unit.scheduler_setup import add, make_scheduler
from tests.unit.test_scheduler import run_step
from tests.unit.test_scheduler_pipelined import report, schedule

ORIGINAL = 8  # the original context: two blocks of 4


def long_rope_scheduler() -> Scheduler:
    return make_scheduler(long_rope_after=ORIGINAL)


def new_request(plan: SchedulerOutput, request_id: str) -> tuple[int, bool] | None:
    """(tokens computed already, long set) of the request's NewRequestData in the plan."""
    for data in plan.new_requests:
        if data.request_id == request_id:
            return data.num_computed_tokens, data.long_rope
    return None


def test_a_prompt_past_the_original_context_is_long_from_its_start() -> None:
    scheduler = long_rope_scheduler()
    add(scheduler, "a", list(range(10, 19)), max_tokens=3)  # 9 tokens
    plan, _ = run_step(scheduler)
    assert new_request(plan, "a") == (0, True)
    assert scheduler.num_preemptions == 0


def test_a_request_growing_past_it_is_computed_again_with_the_long_set() -> None:
    """Pipelined, as the engine runs: the plan that would compute position 8 (the 9th token,
    still in flight) requeues the request; once that token is in, it is computed whole with
    the long set, and generates on."""
    scheduler = long_rope_scheduler()
    add(scheduler, "a", list(range(10, 17)), max_tokens=4)  # 7 tokens: short
    first, sampling = schedule(scheduler)
    assert new_request(first, "a") == (0, False)
    second, second_sampling = schedule(scheduler)  # position 7: the 8th token, still short
    assert second.num_scheduled_tokens == {"a": 1}
    report(scheduler, first, sampling, 100)
    third, _ = schedule(scheduler)  # would compute position 8 (the 9th token, in flight)
    assert third.num_scheduled_tokens == {} and "a" in third.finished_request_ids
    report(scheduler, second, second_sampling, 101)
    fourth, fourth_sampling = schedule(scheduler)
    assert new_request(fourth, "a") == (0, True)
    assert fourth.num_scheduled_tokens == {"a": 9}  # every token again
    report(scheduler, fourth, fourth_sampling, 102)
    later, _ = schedule(scheduler)
    assert later.num_scheduled_tokens == {"a": 1} and not later.new_requests  # once
    assert scheduler.num_preemptions == 0  # not for memory


def test_long_set_blocks_are_not_short_set_prefix_hits() -> None:
    """The same 8 tokens: kept as the short set's blocks (a prompt within the original
    context grown past it), then asked as a long prompt: no hit."""
    scheduler = long_rope_scheduler()
    prompt = list(range(10, 18))  # 8 tokens, two full blocks, short
    add(scheduler, "short", prompt, max_tokens=1)
    run_step(scheduler)
    add(scheduler, "again", [*prompt, 100], max_tokens=1)  # 9 tokens: long
    plan, _ = run_step(scheduler)
    assert new_request(plan, "again") == (0, True)
    add(scheduler, "same short", prompt, max_tokens=1)
    plan, _ = run_step(scheduler)
    assert new_request(plan, "same short") == (4, False)  # the short blocks hit (one left)
