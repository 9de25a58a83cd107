"""Speculative decoding on the executor: the drafts proposed after each step, and laid into
the next row that has room for them.

The scheduler plans a speculating request's decode row with room for its token and up to
`draft_slots` drafts, before it knows the tokens of the step in flight (pipelined, like any
row). Rank 0 proposes when it lays such a row out: it waits for the steps in flight, runs the
proposer once on each (`propose_after`; a proposer with a model of its own has proposed on
the device right after the step, and its drafts are only taken here), and
writes the drafts it found into the plan's `spec_token_ids`, which the other ranks read. The
row then computes its token and those drafts (none where nothing was found).

Waiting for the step before costs the device the pipelined loop's overlap of one step's host
work with the last step's device work, which the scheduler weighs (services/scheduler/
speculation.py); it costs no round trip through the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.executor.runner.step_state import InFlightStep, RequestState
from services.executor.speculative import DeviceProposer, Proposer, proposes_on_device
from shared.protocol import SchedulerOutput


def next_drafts(
    proposer: Proposer | DeviceProposer,
    step: InFlightStep,
    requests: dict[str, RequestState],
) -> dict[str, list[int]]:
    """Drafts for the next step of each speculating request `step` sampled for that is still
    running (`requests`: not ended, preempted or aborted since) and has no later step in
    flight (whose token they would have to guess), cut where its grammar would refuse them.
    A proposer with a model of its own proposed on the device after the step (StepProposer)."""
    pairs = zip(step.sample_ids, step.states, strict=True)
    states = {
        rid: s for rid, s in pairs if s.speculates and not s.num_pending and requests.get(rid) is s
    }
    if proposes_on_device(proposer):
        if step.proposal is None:
            return {}
        drafts = proposer.take_drafts(step.proposal, set(states), requests)
    else:
        drafts = proposer.propose_batch((rid, s.token_ids) for rid, s in states.items())
    kept = {rid: states[rid].allowed_drafts(ids) for rid, ids in drafts.items()}
    return {rid: ids for rid, ids in kept.items() if ids}


def propose_after(
    proposer: Proposer | DeviceProposer | None,
    step: InFlightStep,
    requests: dict[str, RequestState],
) -> None:
    """Once for each finished step, in the order they ran: each speculating request it
    sampled for keeps the drafts for its next row (`next_drafts`: none if a later step of
    it is in flight)."""
    if step.proposed:
        return
    step.proposed = True
    if proposer is None:
        return
    drafts = next_drafts(proposer, step, requests)
    for request_id, state in zip(step.sample_ids, step.states, strict=True):
        if state.speculates:
            state.next_drafts = drafts.get(request_id, [])


def choose_drafts(
    plan: SchedulerOutput,
    requests: dict[str, RequestState],
    in_flight: Iterable[InFlightStep],
    proposer: Proposer | DeviceProposer | None,
) -> None:
    """On rank 0: the drafts of each row of `plan` with draft slots, at most that many, into
    `plan.spec_token_ids`. Waits for the steps in flight first where such a row's request
    has one (its drafts follow that step's tokens)."""
    if not plan.draft_slots:
        return
    states = [(rid, requests[rid], slots) for rid, slots in plan.draft_slots.items()]
    waits = waits_for_drafts(plan, requests)
    for step in in_flight:  # oldest first
        if waits:
            step.finish()
        if step.output is not None:  # finished
            propose_after(proposer, step, requests)
    for request_id, state, slots in states:
        drafts, state.next_drafts = state.next_drafts[:slots], []
        if drafts:
            plan.spec_token_ids[request_id] = drafts


def waits_for_drafts(plan: SchedulerOutput, requests: dict[str, RequestState]) -> bool:
    """Whether rank 0 waits for the steps in flight to lay out `plan`: a row of it has draft
    slots and a step in flight that samples for its request."""
    return any(
        (state := requests.get(rid)) is not None and state.num_pending for rid in plan.draft_slots
    )
