"""Prefill/decode disaggregation in the scheduler (services/scheduler/handover.py): a prefill
engine ends a handed-over request after its first token and exports its prompt's full blocks
in the next plan; a decode engine imports the blocks it lacks and, if the fetch fails, computes
the prompt itself. Driven directly, with the executor replayed as in test_scheduler."""

from __future__ import annotations

from services.scheduler.scheduler import Scheduler
from shared.protocol import (
    EngineRequest,
    FinishReason,
    KVTransfer,
    ModelRunnerOutput,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
)
from tests.unit.scheduler_setup import make_scheduler

PROMPT = list(range(10, 24))  # 14 tokens: 3 full blocks of 4, and 2 more


def send(
    scheduler: Scheduler, transfer: KVTransfer, outputs: list[int] = (), **params: object
) -> None:
    params.setdefault("max_tokens", 6)
    scheduler.add_request(
        EngineRequest(
            request_id="r",
            prompt_token_ids=PROMPT,
            sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
            output_token_ids=list(outputs),
            kv_transfer=transfer,
        )
    )


def step(
    scheduler: Scheduler, failed: tuple[str, ...] = ()
) -> tuple[SchedulerOutput, list[RequestOutput]]:
    plan = scheduler.schedule()
    scheduler.check_invariants()
    sampled = {}
    for request_id in plan.num_scheduled_tokens:
        request = scheduler.requests.get(request_id)
        if request is not None and request.num_computed_tokens == request.num_tokens:
            sampled[request_id] = [100 + request.num_output_tokens]
    result = ModelRunnerOutput(step=plan.step, sampled=sampled, kv_import_failed=list(failed))
    outputs = scheduler.update(plan, result)
    scheduler.check_invariants()
    return plan, outputs


def test_the_plan_completing_a_handed_over_prompt_exports_its_full_blocks() -> None:
    scheduler = make_scheduler(kv_transfer=True, max_num_batched_tokens=8)
    send(scheduler, KVTransfer(export=True))
    before = scheduler.stats()
    plan, outputs = step(scheduler)  # a chunk of the prompt: nothing to export yet
    assert plan.num_scheduled_tokens == {"r": 8} and not plan.kv_exports and outputs == []
    scheduler_blocks = list(scheduler.kv.block_ids["r"])
    plan, [output] = step(scheduler)  # the rest of it: its blocks go out after this step
    [export] = plan.kv_exports
    assert export.request_id == "r" and len(export.block_ids) == 3
    assert export.block_ids[:2] == scheduler_blocks  # the first chunk's two, then one more
    assert output.new_token_ids == [100] and output.handed_over
    assert output.finish_reason is FinishReason.LENGTH
    assert "r" not in scheduler.kv.block_ids and not scheduler.has_unfinished()
    assert scheduler.kv.pool.num_referenced == 0
    assert scheduler.stats().kv_transfer.blocks_exported == 3  # type: ignore[union-attr]
    assert before.kv_transfer.blocks_exported == 0  # type: ignore[union-attr]  # kept its figure


def test_a_request_that_ends_with_its_first_token_exports_nothing() -> None:
    scheduler = make_scheduler()
    send(scheduler, KVTransfer(export=True), max_tokens=1)
    plan, [output] = step(scheduler)
    assert not plan.kv_exports
    assert not output.handed_over and output.finish_reason is FinishReason.LENGTH


def test_a_decode_engine_imports_the_blocks_it_lacks_and_continues() -> None:
    scheduler = make_scheduler(kv_transfer=True)
    send(scheduler, KVTransfer(source=0), outputs=[100])
    plan, [output] = step(scheduler)
    [entry] = plan.kv_imports
    assert (entry.source, entry.first, len(entry.block_ids)) == (0, 0, 3)
    assert entry.block_ids == plan.new_requests[0].block_ids[:3]
    assert plan.new_requests[0].num_computed_tokens == 12
    assert plan.num_scheduled_tokens == {"r": 3}  # the prompt's last 2 tokens and the first output
    assert output.new_token_ids == [101]  # the first output is not sent again
    assert scheduler.stats().kv_transfer.blocks_imported == 3  # type: ignore[union-attr]
    for _ in range(4):
        step(scheduler)
    assert not scheduler.has_unfinished()


def test_imported_blocks_are_cached_only_once_the_fetch_is_reported_good() -> None:
    scheduler = make_scheduler()
    send(scheduler, KVTransfer(source=0), outputs=[100])
    plan = scheduler.schedule()
    assert scheduler.kv.pool.lookup(scheduler.requests["r"].block_hashes[0]) is None
    # Until then it runs no further step.
    assert "r" not in scheduler.schedule().num_scheduled_tokens
    scheduler.update(plan, ModelRunnerOutput(step=plan.step, sampled={"r": [101]}))
    step(scheduler)
    assert scheduler.kv.pool.lookup(scheduler.requests["r"].block_hashes[0]) is not None


def test_a_failed_fetch_voids_the_token_and_computes_the_prompt_here() -> None:
    scheduler = make_scheduler(kv_transfer=True)
    send(scheduler, KVTransfer(source=0), outputs=[100])
    plan, outputs = step(scheduler, failed=("r",))
    assert plan.kv_imports and outputs == []
    assert scheduler.stats().kv_transfer.failed_imports == 1  # type: ignore[union-attr]
    plan, [output] = step(scheduler)
    assert not plan.kv_imports and plan.new_requests[0].num_computed_tokens == 0
    assert plan.num_scheduled_tokens == {"r": 15}  # the whole prompt, and the first output
    assert output.new_token_ids == [101]
    assert scheduler.num_preemptions == 0


def test_a_decode_engine_imports_past_its_own_prefix_hits() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(
        EngineRequest(
            request_id="warm",
            prompt_token_ids=PROMPT[:9],
            sampling_params=SamplingParams(max_tokens=1),
        )
    )
    step(scheduler)
    step(scheduler)  # its two full blocks are cached
    send(scheduler, KVTransfer(source=1), outputs=[100])
    plan, _ = step(scheduler)
    [entry] = plan.kv_imports
    assert (entry.source, entry.first, len(entry.block_ids)) == (1, 2, 1)


def test_an_import_admitted_into_a_held_plan_is_reported_with_it() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(
        EngineRequest(
            request_id="other",
            prompt_token_ids=[1, 2, 3],
            sampling_params=SamplingParams(max_tokens=8),
        )
    )
    plan = scheduler.schedule()
    send(scheduler, KVTransfer(source=0), outputs=[100])
    addendum = scheduler.schedule_addendum(plan)
    assert addendum is not None and [e.request_id for e in addendum.kv_imports] == ["r"]
    assert plan.kv_imports == addendum.kv_imports
    sampled = {"other": [7], "r": [101]}
    [*_] = scheduler.update(plan, ModelRunnerOutput(step=plan.step, sampled=sampled))
    assert not scheduler.handover.waits(scheduler.requests["r"])
    assert "r" in scheduler.schedule().num_scheduled_tokens
