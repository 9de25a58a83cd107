"""The executor's host-side checks of a plan: what a scheduler of its session sends passes,
and each inconsistency is a PlanError naming it (services/executor/runner/plan_check.py)."""

from __future__ import annotations

import pytest

from services.executor.runner.plan_check import PlanError, PlanLimits, check_plan
from shared.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput

LIMITS = PlanLimits(
    vocab_size=100,
    num_blocks=8,
    block_size=4,
    max_model_len=64,
    max_num_seqs=2,
    max_num_batched_tokens=16,
)
HELD = {"old": (6, 2)}  # 6 tokens (one in flight), 2 blocks


def plan(
    new: list[NewRequestData] = (),  # type: ignore[assignment]
    cached: list[CachedRequestData] = (),  # type: ignore[assignment]
    scheduled: dict[str, int] | None = None,
    finished: list[str] = (),  # type: ignore[assignment]
) -> SchedulerOutput:
    return SchedulerOutput(
        step=1,
        new_requests=list(new),
        cached_requests=list(cached),
        num_scheduled_tokens=scheduled or {},
        finished_request_ids=list(finished),
    )


def new(
    request_id: str = "r", tokens: list[int] | None = None, blocks: list[int] | None = None, **p
) -> NewRequestData:
    return NewRequestData(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3, 4, 5] if tokens is None else tokens,
        output_token_ids=[],
        sampling_params=SamplingParams(**p),
        block_ids=[0, 1] if blocks is None else blocks,
        num_computed_tokens=0,
    )


def decode(request_id: str = "old", new_blocks: list[int] = (), computed: int = 5):  # type: ignore[assignment]
    return CachedRequestData(
        request_id=request_id, new_block_ids=list(new_blocks), num_computed_tokens=computed
    )


def check(p: SchedulerOutput, num_rows: int = 0) -> None:
    check_plan(p, LIMITS, HELD.get, num_rows)


def test_what_a_scheduler_sends_passes() -> None:
    check(plan([new()], [decode()], {"r": 5, "old": 1}))
    check(plan([new("old")], scheduled={"old": 5}, finished=["old"]))  # dropped, then new again


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (plan([new(blocks=[8])], scheduled={"r": 5}), "block id out of range"),
        (plan([new(blocks=[-1])], scheduled={"r": 5}), "block id out of range"),
        (plan([new(tokens=[100])], scheduled={"r": 1}), "token id out of range"),
        (plan([new(top_k=0)], scheduled={"r": 5}), "top_k"),
        (plan([new(tokens=[])], scheduled={"r": 1}), "num_computed_tokens"),
        (plan(cached=[decode("ghost")], scheduled={"ghost": 1}), "not held"),
        (plan(scheduled={"old": 1}), "does not hold"),
        (plan([new()], scheduled={"r": 9}), "9 tokens from 0"),
        (plan([new(blocks=[0])], scheduled={"r": 5}), "5 tokens in 1 blocks"),
        (plan(cached=[decode()], scheduled={"old": 1}, finished=["old"]), "not held"),
        (plan([new("a"), new("b"), new("c")], scheduled=dict.fromkeys("abc", 1)), "max_num_seqs"),
        (
            plan([new(tokens=list(range(17)), blocks=[0, 1, 2, 3, 4])], scheduled={"r": 17}),
            "more than 16 tokens",
        ),
    ],
)
def test_each_inconsistency_is_a_plan_error(bad: SchedulerOutput, says: str) -> None:
    with pytest.raises(PlanError, match=says):
        check(bad)


def test_an_addendum_counts_the_rows_of_the_prepared_step() -> None:
    check(plan([new()], scheduled={"r": 5}), num_rows=1)
    with pytest.raises(PlanError, match="max_num_seqs"):
        check(plan([new()], scheduled={"r": 5}), num_rows=2)


def with_drafts(slots: dict[str, int], drafts: dict[str, list[int]] | None = None, n: int = 4):
    """A decode of "old" with `n` tokens and draft slots (rank 0's drafts, if any)."""
    p = plan(cached=[decode()], scheduled={"old": n})
    p.draft_slots = slots
    p.spec_token_ids = drafts or {}
    return p


def test_draft_slots_and_rank_0s_drafts_pass_within_the_proposers_length() -> None:
    limits = PlanLimits(**{**LIMITS.__dict__, "num_speculative_tokens": 3})
    held = {"old": (6, 3)}  # blocks for its token and 3 drafts
    check_plan(with_drafts({"old": 3}), limits, held.get)
    check_plan(with_drafts({"old": 3}, {"old": [7, 8]}), limits, held.get)
    bad = [
        (with_drafts({"old": 3}), PlanLimits(**{**LIMITS.__dict__, "num_speculative_tokens": 2})),
        (with_drafts({"old": 2}), limits),  # 4 tokens: its own and 3, not 2
        (with_drafts({"old": 1}, {"old": [7, 8]}, n=2), limits),
        (with_drafts({}, {"old": [7]}, n=1), limits),  # drafts without slots
        (with_drafts({"old": 3}, {"old": [100]}), limits),
    ]
    for p, lim in bad:
        with pytest.raises(PlanError, match="draft"):
            check_plan(p, lim, held.get)
