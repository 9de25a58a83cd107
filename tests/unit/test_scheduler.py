"""The scheduler driven directly, with the executor's sampling rule replayed by `run_step`."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from shared.protocol import (
    FinishReason,
    ModelRunnerOutput,
    ParameterError,
    RequestOutput,
    SchedulerOutput,
)
from tests.unit.scheduler_setup import EOS, add, make_scheduler

TokenFn = Callable[[Request], int]


def constant(token_id: int) -> TokenFn:
    return lambda request: token_id


def counting(request: Request) -> int:
    """A distinct token per position, never EOS: 100, 101, 102, ..."""
    return 100 + request.num_output_tokens


def run_step(
    scheduler: Scheduler, token_fn: TokenFn = counting
) -> tuple[SchedulerOutput, list[RequestOutput]]:
    """One engine step; like the executor, sample for requests that reached their last token."""
    plan = scheduler.schedule()
    scheduler.check_invariants()
    sampled = {}
    for request_id in plan.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        if request.num_computed_tokens == request.num_tokens:
            sampled[request_id] = [token_fn(request)]
    outputs = scheduler.update(plan, ModelRunnerOutput(step=plan.step, sampled=sampled))
    scheduler.check_invariants()
    return plan, outputs


def run_to_end(
    scheduler: Scheduler, token_fn: TokenFn = counting, max_steps: int = 500
) -> dict[str, list[RequestOutput]]:
    """Step until nothing is left; return every output, by request id."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outputs
        for output in run_step(scheduler, token_fn)[1]:
            outputs.setdefault(output.request_id, []).append(output)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for output in outputs for t in output.new_token_ids]


def final(outputs: list[RequestOutput]) -> RequestOutput:
    """The one output that carries a finish reason, which must be the last."""
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    return outputs[-1]


def num_referenced(scheduler: Scheduler) -> int:
    return scheduler.kv.pool.counts()[2]


def prompt_of(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


# ---------------------------------------------------------------- prefix cache


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefix_hit_computes_only_the_rest(block_size: int):
    scheduler = make_scheduler(block_size=block_size, num_blocks=32)
    prefix = prompt_of(5 * block_size)
    add(scheduler, "a", [*prefix, 500, 501, 502])
    run_to_end(scheduler)
    prompt = [*prefix, *[600] * 7]
    add(scheduler, "b", prompt)
    plan, outputs = run_step(scheduler)
    assert plan.num_scheduled_tokens["b"] == len(prompt) - 5 * block_size
    assert plan.new_requests[0].num_computed_tokens == 5 * block_size
    assert outputs[0].num_cached_tokens == 5 * block_size


def test_without_prefix_caching_everything_is_computed():
    scheduler = make_scheduler(enable_prefix_caching=False)
    prefix = prompt_of(20)
    add(scheduler, "a", [*prefix, 500])
    run_to_end(scheduler)
    add(scheduler, "b", [*prefix, 600])
    plan, outputs = run_step(scheduler)
    assert plan.num_scheduled_tokens["b"] == 21
    assert plan.new_requests[0].num_computed_tokens == 0
    assert outputs[0].num_cached_tokens == 0


def test_a_fully_cached_prompt_still_computes_its_last_token():
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_of(21))
    run_to_end(scheduler)
    add(scheduler, "b", prompt_of(21))
    plan, outputs = run_step(scheduler)
    assert plan.num_scheduled_tokens["b"] == 1
    assert [o.new_token_ids for o in outputs] == [[100]]


def test_a_block_aligned_cached_prompt_recomputes_its_last_block():
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_of(20))
    run_to_end(scheduler)
    add(scheduler, "b", prompt_of(20))
    plan, _ = run_step(scheduler)
    assert plan.num_scheduled_tokens["b"] == 4  # only full blocks are reused
    assert plan.new_requests[0].num_computed_tokens == 16


def test_prefix_cache_counters_count_prompt_tokens_looked_up_and_found():
    scheduler = make_scheduler()
    add(scheduler, "a", [*prompt_of(20), 500, 501, 502])
    run_to_end(scheduler)
    add(scheduler, "b", [*prompt_of(20), 600, 601])
    run_to_end(scheduler)
    stats = scheduler.stats()
    assert stats.prefix_cache_queries == 23 + 22
    assert stats.prefix_cache_hits == 20


def test_a_request_admitted_in_the_same_step_reuses_a_prefix_being_computed():
    scheduler = make_scheduler()
    add(scheduler, "a", [*prompt_of(8), 500])
    add(scheduler, "b", [*prompt_of(8), 600])
    plan, _ = run_step(scheduler)
    assert plan.num_scheduled_tokens == {"a": 9, "b": 1}
    a, b = plan.new_requests
    assert b.block_ids[:2] == a.block_ids[:2]


# ---------------------------------------------------------------- eviction


def test_eviction_drops_the_least_recently_used_prefix():
    # 7 blocks of 4; a 9-token prompt with max_tokens=1 leaves 2 cached blocks behind.
    scheduler = make_scheduler(num_blocks=7)
    prompts = {name: prompt_of(9, start) for name, start in [("a", 10), ("b", 30), ("c", 50)]}

    def run_alone(request_id: str, prompt: list[int]) -> int:
        add(scheduler, request_id, prompt, max_tokens=1)
        return final(run_to_end(scheduler)[request_id]).num_cached_tokens

    for name, prompt in prompts.items():
        assert run_alone(name, prompt) == 0  # 6 blocks cached, 1 free
    assert run_alone("a-again", prompts["a"]) == 8  # "a" becomes the most recently used
    assert run_alone("d", prompt_of(9, 70)) == 0  # the free block, then evicts 2 blocks
    assert run_alone("a-third", prompts["a"]) == 8
    assert run_alone("c-again", prompts["c"]) == 8
    assert run_alone("b-again", prompts["b"]) == 0  # the least recently used lost its cache


# ---------------------------------------------------------------- continuous batching


def test_running_requests_are_scheduled_before_waiting_ones():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    add(scheduler, "a", prompt_of(8))
    run_step(scheduler)
    add(scheduler, "b", prompt_of(12, 100))
    plan, _ = run_step(scheduler)
    assert list(plan.num_scheduled_tokens.items()) == [("a", 1), ("b", 9)]
    assert [c.request_id for c in plan.cached_requests] == ["a"]
    assert [n.request_id for n in plan.new_requests] == ["b"]


def test_max_num_seqs_caps_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        add(scheduler, name, prompt_of(4), max_tokens=2)
    plan, _ = run_step(scheduler)
    assert list(plan.num_scheduled_tokens) == ["a", "b"]
    assert scheduler.stats().num_waiting == 1
    run_step(scheduler)  # a and b finish
    plan, _ = run_step(scheduler)
    assert list(plan.num_scheduled_tokens) == ["c"]


def test_every_step_stays_within_the_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    for n, name in enumerate("abcdef"):
        add(scheduler, name, prompt_of(5 + 7 * n, 20 * n), max_tokens=3)
    for _ in range(40):
        plan, _ = run_step(scheduler)
        assert plan.total_num_scheduled_tokens <= 16
        assert len(plan.num_scheduled_tokens) <= 4
    assert not scheduler.has_unfinished()


def test_a_long_prompt_is_chunked_across_steps():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    add(scheduler, "a", prompt_of(50), max_tokens=2)
    chunks, computed, sampled = [], [], []
    for _ in range(5):
        plan, outputs = run_step(scheduler)
        chunks.append(plan.num_scheduled_tokens["a"])
        computed += [c.num_computed_tokens for c in plan.cached_requests]
        sampled.append(bool(outputs))
    assert chunks == [16, 16, 16, 2, 1]
    assert computed == [16, 32, 48, 50]  # where each later chunk starts
    assert sampled == [False, False, False, True, True]  # only the end of the prompt samples


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    add(scheduler, "a", prompt_of(8), max_tokens=3)
    run_step(scheduler)
    add(scheduler, "b", prompt_of(10, 100))
    plan, _ = run_step(scheduler)
    assert plan.num_scheduled_tokens == {"a": 1}  # 9 tokens of budget left: b is not split
    run_step(scheduler)  # a finishes
    plan, _ = run_step(scheduler)
    assert plan.num_scheduled_tokens == {"b": 10}


# ---------------------------------------------------------------- preemption


def tiny_pool_with_two_decodes() -> Scheduler:
    """4 blocks of 4, all held by a and b after 3 decode steps; a's next token needs a 5th."""
    scheduler = make_scheduler(num_blocks=4, max_model_len=64)
    add(scheduler, "a", prompt_of(6), max_tokens=6)
    add(scheduler, "b", prompt_of(6, 40), max_tokens=6)
    for _ in range(3):
        run_step(scheduler)
    assert scheduler.kv.pool.counts() == (0, 0, 4)
    return scheduler


def test_a_decode_without_a_block_preempts_the_most_recently_admitted():
    scheduler = tiny_pool_with_two_decodes()
    plan, _ = run_step(scheduler)
    assert plan.num_scheduled_tokens == {"a": 1}
    assert plan.finished_request_ids == ["b"]
    assert scheduler.requests["b"].status is RequestStatus.WAITING
    assert "b" not in scheduler.kv.block_ids
    assert scheduler.stats().num_preemptions == 1


def test_a_preempted_request_goes_to_the_front_of_waiting():
    scheduler = tiny_pool_with_two_decodes()
    add(scheduler, "c", prompt_of(4, 80))
    run_step(scheduler)
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_a_preempted_request_resumes_with_its_outputs_and_finishes_whole():
    scheduler = tiny_pool_with_two_decodes()
    outputs = run_to_end(scheduler)
    assert tokens_of(outputs["b"]) == [103, 104, 105]  # after the 3 from before preemption
    assert final(outputs["a"]).finish_reason is FinishReason.LENGTH
    assert final(outputs["b"]).finish_reason is FinishReason.LENGTH


def test_a_resumed_request_is_sent_as_new_with_its_generated_tokens():
    scheduler = tiny_pool_with_two_decodes()
    resumed = None
    while resumed is None:
        plan, _ = run_step(scheduler)
        resumed = next((n for n in plan.new_requests if n.request_id == "b"), None)
    assert resumed.prompt_token_ids == prompt_of(6, 40)
    assert resumed.output_token_ids == [100, 101, 102]


def test_a_preempted_request_longer_than_the_budget_resumes_without_chunked_prefill():
    # Regression: b recomputes 13 tokens against a 9-token budget and used to wait forever.
    scheduler = make_scheduler(
        num_blocks=7,
        max_num_batched_tokens=9,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
    )
    add(scheduler, "a", prompt_of(8), max_tokens=12)
    add(scheduler, "b", prompt_of(8, 40), max_tokens=12)
    outputs = run_to_end(scheduler)
    assert scheduler.num_preemptions >= 1
    assert len(tokens_of(outputs["b"])) == 12


# ---------------------------------------------------------------- stop conditions


def test_eos_stops_a_request():
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_of(4), max_tokens=10)
    outputs = run_to_end(scheduler, lambda r: EOS if r.num_output_tokens == 2 else 7)
    assert tokens_of(outputs["a"]) == [7, 7, EOS]
    assert final(outputs["a"]).finish_reason is FinishReason.STOP


def test_ignore_eos_runs_to_max_tokens():
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_of(4), max_tokens=5, ignore_eos=True)
    outputs = run_to_end(scheduler, constant(EOS))
    assert tokens_of(outputs["a"]) == [EOS] * 5
    assert final(outputs["a"]).finish_reason is FinishReason.LENGTH


def test_a_stop_token_id_stops_a_request_even_with_ignore_eos():
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_of(4), max_tokens=10, stop_token_ids=[9], ignore_eos=True)
    outputs = run_to_end(scheduler, lambda r: 9 if r.num_output_tokens == 1 else 7)
    assert tokens_of(outputs["a"]) == [7, 9]
    assert final(outputs["a"]).finish_reason is FinishReason.STOP


@pytest.mark.parametrize("stop", [{}, {"stop_token_ids": [9]}], ids=["eos", "stop_token_ids"])
def test_min_tokens_delays_stopping(stop: dict):
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_of(4), max_tokens=10, min_tokens=3, **stop)
    token = 9 if stop else EOS
    outputs = run_to_end(scheduler, constant(token))
    # Stop tokens count once the output (them included) reaches min_tokens, as in vLLM;
    # the executor's sampler masks them before that.
    assert tokens_of(outputs["a"]) == [token] * 3
    assert final(outputs["a"]).finish_reason is FinishReason.STOP


def test_max_tokens_ends_with_length():
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_of(4), max_tokens=3)
    outputs = run_to_end(scheduler)
    assert tokens_of(outputs["a"]) == [100, 101, 102]
    assert final(outputs["a"]).finish_reason is FinishReason.LENGTH


def test_max_model_len_ends_with_length():
    scheduler = make_scheduler(max_model_len=16)
    add(scheduler, "a", prompt_of(10), max_tokens=None)
    outputs = run_to_end(scheduler)
    assert len(tokens_of(outputs["a"])) == 6
    assert final(outputs["a"]).finish_reason is FinishReason.LENGTH


# ---------------------------------------------------------------- abort


def test_aborting_a_waiting_request_ends_it_with_abort():
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_of(4))
    [output] = scheduler.abort(["a"])
    assert (output.request_id, output.finish_reason) == ("a", FinishReason.ABORT)
    assert output.new_token_ids == []
    plan, outputs = run_step(scheduler)
    assert plan.num_scheduled_tokens == {} and outputs == []
    assert not scheduler.has_unfinished()


def test_aborting_a_running_request_frees_its_blocks_and_tells_the_executor():
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_of(10))
    run_step(scheduler)
    [output] = scheduler.abort(["a"])
    assert output.finish_reason is FinishReason.ABORT
    assert num_referenced(scheduler) == 0
    scheduler.check_invariants()
    plan, _ = run_step(scheduler)
    assert plan.finished_request_ids == ["a"]
    assert plan.num_scheduled_tokens == {}


def test_a_token_sampled_for_a_request_aborted_mid_step_is_dropped():
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_of(4))
    plan = scheduler.schedule()
    scheduler.abort(["a"])
    outputs = scheduler.update(plan, ModelRunnerOutput(step=plan.step, sampled={"a": [7]}))
    assert outputs == []
    scheduler.check_invariants()
    assert num_referenced(scheduler) == 0


def test_aborting_an_unknown_or_finished_request_is_a_no_op():
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_of(4), max_tokens=1)
    run_to_end(scheduler)
    run_step(scheduler)  # reports "a" as finished to the executor
    assert scheduler.abort(["a", "never-seen"]) == []
    plan, _ = run_step(scheduler)
    assert plan.finished_request_ids == []


def test_aborting_twice_ends_a_request_once():
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_of(4))
    assert len(scheduler.abort(["a", "a"])) == 1
    assert scheduler.abort(["a"]) == []


# ---------------------------------------------------------------- admission


@pytest.mark.parametrize(
    ("prompt_len", "params", "param"),
    [
        (0, {}, "prompt"),
        (32, {}, "prompt"),  # == max_model_len: no room to generate
        (40, {}, "prompt"),
        (30, {"max_tokens": 3}, "max_tokens"),
        (4, {"temperature": -0.5}, "temperature"),
        (4, {"top_p": 0.0}, "top_p"),
        (4, {"top_p": 1.5}, "top_p"),
        (4, {"max_tokens": 0}, "max_tokens"),
    ],
    ids=[
        "empty-prompt",
        "prompt-at-max-model-len",
        "prompt-over-max-model-len",
        "max-tokens-over-max-model-len",
        "negative-temperature",
        "zero-top-p",
        "top-p-over-1",
        "zero-max-tokens",
    ],
)
def test_invalid_requests_are_rejected_naming_the_parameter(prompt_len, params, param):
    scheduler = make_scheduler(max_model_len=32)
    with pytest.raises(ParameterError) as error:
        add(scheduler, "a", prompt_of(prompt_len), **params)
    assert error.value.param == param
    assert not scheduler.has_unfinished()


def test_a_request_needing_more_blocks_than_the_pool_is_rejected():
    scheduler = make_scheduler(num_blocks=4, max_model_len=64)
    with pytest.raises(ParameterError) as error:
        add(scheduler, "a", prompt_of(10), max_tokens=10)  # 20 tokens: 5 blocks of 4
    assert error.value.param == "max_tokens"


def test_without_chunked_prefill_a_prompt_over_the_budget_is_rejected():
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ParameterError) as error:
        add(scheduler, "a", prompt_of(9))
    assert error.value.param == "prompt"


def test_a_duplicate_request_id_is_rejected_and_the_first_kept():
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_of(4), max_tokens=2)
    with pytest.raises(ParameterError) as error:
        add(scheduler, "a", prompt_of(6))
    assert error.value.param == "request_id"
    outputs = run_to_end(scheduler)
    assert final(outputs["a"]).num_prompt_tokens == 4


# ---------------------------------------------------------------- endings


def test_every_request_ends_exactly_once():
    scheduler = make_scheduler(num_blocks=12, max_num_batched_tokens=12, max_num_seqs=3)
    for n in range(8):
        add(scheduler, f"r{n}", prompt_of(3 + 2 * n, 7 * n), max_tokens=3 + n)
    ends: dict[str, list[FinishReason]] = {}

    def record(outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished:
                ends.setdefault(output.request_id, []).append(output.finish_reason)

    run_step(scheduler)
    record(scheduler.abort(["r0", "r7"]))  # one running, one waiting

    def eos_for_r3(request: Request) -> int:
        return EOS if request.request_id == "r3" else 7

    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        record(run_step(scheduler, eos_for_r3)[1])
    record(scheduler.abort([f"r{n}" for n in range(8)]))
    assert ends == {
        "r0": [FinishReason.ABORT],
        "r7": [FinishReason.ABORT],
        "r3": [FinishReason.STOP],
        **{f"r{n}": [FinishReason.LENGTH] for n in (1, 2, 4, 5, 6)},
    }
    assert scheduler.kv.pool.counts()[2] == 0


def test_a_full_waiting_queue_refuses_new_requests() -> None:
    from shared.protocol import QueueFullError

    scheduler = make_scheduler(max_queued_requests=2)
    add(scheduler, "a", prompt_of(4))
    add(scheduler, "b", prompt_of(4))
    with pytest.raises(QueueFullError):
        add(scheduler, "c", prompt_of(4))
    scheduler.schedule()  # a and b start running: the queue has room again
    add(scheduler, "c", prompt_of(4))
    scheduler.check_invariants()


def test_the_stats_keep_the_newest_experts_load_the_executor_read():
    """The executor reads a mixture of experts' load once a second; steps between carry none."""
    scheduler = make_scheduler()
    add(scheduler, "a", prompt_of(4), max_tokens=3)
    loads = [([3, 5], [-1, -1]), ([], []), ([4, 9], [0, 1])]
    for tokens, ranks in loads:
        plan = scheduler.schedule()
        result = ModelRunnerOutput(
            step=plan.step, sampled={"a": [7]}, expert_tokens=tokens, expert_ranks=ranks
        )
        scheduler.update(plan, result)
        newest = next(
            load for load in reversed(loads[: loads.index((tokens, ranks)) + 1]) if load[0]
        )
        assert (scheduler.stats().expert_tokens, scheduler.stats().expert_ranks) == newest
