"""The checks a plan passes on the host before the executor takes it.

The scheduler is the only sender (over an owner-only or CURVE socket), so a plan that fails
here means a scheduler bug or a desynchronized session; left unchecked it would crash the
executor (an unknown request), write into another request's KV blocks (a block id out of
range), or, on CUDA, end in a device assert that ruins the process's GPU context. The loop
answers a PlanError by forgetting every request and reporting as a new executor, so the
scheduler fails what it held and adopts the executor again (services/executor/process.py).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field

from shared.protocol import ParameterError, SchedulerOutput


class PlanError(RuntimeError):
    """A plan, addendum or launch that no scheduler of this executor's session would send."""


@dataclass(frozen=True)
class PlanLimits:
    """What the executor sized itself for (what its ExecutorReady said)."""

    vocab_size: int
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    lora_ids: Container[int] = field(default=())  # the LoRA adapters it has taken
    num_speculative_tokens: int = 0  # drafts a row may verify
    num_host_blocks: int = 0  # slots of the host KV tier
    num_groups: int = 1  # layer groups: a request's blocks are one of each group's in turn


# A request's tokens known or in flight (at most: a row verifying drafts may bring up to 1 +
# num_speculative_tokens), and its blocks.
Held = Callable[[str], tuple[int, int] | None]


def check_plan(
    plan: SchedulerOutput,
    limits: PlanLimits,
    held: Held,
    num_rows: int = 0,
    num_tokens: int = 0,
) -> None:
    """Raise PlanError at the first inconsistency of `plan`.

    `held` says, for each request the executor holds, its tokens (known or in flight) and
    blocks, None for one it does not; `num_rows`, `num_tokens`: what the prepared step holds
    already (for an addendum). Costs a few lookups per row: decode steps stay cheap.
    """
    dropped = set(plan.finished_request_ids)
    known: dict[str, tuple[int, int] | None] = dict.fromkeys(dropped)
    for data in plan.new_requests:
        _in_range(data.block_ids, limits.num_blocks, f"{data.request_id}: block id")
        tokens = data.prompt_token_ids + data.output_token_ids
        _in_range(tokens, limits.vocab_size, f"{data.request_id}: token id")
        try:
            data.sampling_params.validate(limits.vocab_size)
        except ParameterError as exc:
            raise PlanError(f"{data.request_id}: {exc}") from None
        if not 0 <= data.num_computed_tokens < len(tokens):
            raise PlanError(f"{data.request_id}: num_computed_tokens out of range")
        if data.lora_id and data.lora_id not in limits.lora_ids:
            raise PlanError(f"{data.request_id}: LoRA adapter id {data.lora_id} is unknown here")
        known[data.request_id] = (len(tokens), len(data.block_ids))
    for delta in plan.cached_requests:
        state = known[delta.request_id] if delta.request_id in known else held(delta.request_id)
        if state is None:
            raise PlanError(f"cached rows of {delta.request_id!r}, which is not held")
        _in_range(delta.new_block_ids, limits.num_blocks, f"{delta.request_id}: block id")
        known[delta.request_id] = (state[0], state[1] + len(delta.new_block_ids))
    _check_host_copies(plan, limits)
    for handover in (*plan.kv_exports, *plan.kv_imports):  # disaggregation's blocks
        _in_range(handover.block_ids, limits.num_blocks, f"{handover.request_id}: handed over")
    _check_rows(plan, limits, known, num_rows, num_tokens)


def _check_host_copies(plan: SchedulerOutput, limits: PlanLimits) -> None:
    """The host tier's copies name blocks and slots that exist."""
    if plan.host_copies is None:
        return
    for block, slot in plan.host_copies.offloads:
        _in_range([block], limits.num_blocks, "offload: block id")
        _in_range([slot], limits.num_host_blocks, "offload: host slot")
    for slot, block in plan.host_copies.onloads:
        _in_range([slot], limits.num_host_blocks, "onload: host slot")
        _in_range([block], limits.num_blocks, "onload: block id")
    copies = plan.host_copies
    offloaded = {slot for _, slot in copies.offloads}
    if any(slot not in offloaded for slot, _ in copies.disk_stores):
        raise PlanError("disk store: a host slot the plan does not offload to")
    _in_range([slot for _, slot in copies.disk_loads], limits.num_host_blocks, "disk load: slot")
    _in_range([block for block, _ in copies.disk_direct], limits.num_blocks, "disk: block id")
    hashes = [*copies.disk_deletes, *(h for _, h in [*copies.disk_stores, *copies.disk_direct])]
    if any(len(h) != 32 for h in hashes + [h for h, _ in copies.disk_loads]):
        raise PlanError("disk tier: a block hash that is not 32 bytes (sha256)")


def _check_rows(
    plan: SchedulerOutput,
    limits: PlanLimits,
    known: dict[str, tuple[int, int] | None],
    num_rows: int,
    num_tokens: int,
) -> None:
    """The rows: each of a request the plan holds, within its tokens, blocks and the limits.
    NOTE: every row has a cached or new entry (the scheduler sends one per row), so `known`
    has it."""
    if num_rows + len(plan.num_scheduled_tokens) > limits.max_num_seqs:
        raise PlanError(f"more than {limits.max_num_seqs} rows (max_num_seqs)")
    if num_tokens + sum(plan.num_scheduled_tokens.values()) > limits.max_num_batched_tokens:
        raise PlanError(f"more than {limits.max_num_batched_tokens} tokens in one step")
    if (
        not plan.spec_token_ids.keys()
        <= plan.draft_slots.keys()
        <= plan.num_scheduled_tokens.keys()
    ):
        raise PlanError("drafts for a request without a row or draft slots")
    computed = {d.request_id: d.num_computed_tokens for d in plan.cached_requests}
    computed.update((d.request_id, d.num_computed_tokens) for d in plan.new_requests)
    for request_id, num_new in plan.num_scheduled_tokens.items():
        state = known.get(request_id)
        if state is None or request_id not in computed:
            raise PlanError(f"tokens scheduled for {request_id!r}, which the plan does not hold")
        length, num_blocks = state
        # The count and end as planned: with draft slots, bounds (the drafts are the
        # executor's, and its steps in flight may bring fewer tokens than they have room for).
        end = computed[request_id] + num_new
        slots = plan.draft_slots.get(request_id, 0)
        _check_drafts(request_id, plan.spec_token_ids.get(request_id, []), slots, num_new, limits)
        # One token past what is known may be the one in flight (see ModelRunner._add_row).
        own_end = end - slots
        if num_new < 1 or own_end > length + 1 or end > limits.max_model_len:
            raise PlanError(f"{request_id}: {num_new} tokens from {computed[request_id]}")
        if end > num_blocks // limits.num_groups * limits.block_size:
            raise PlanError(f"{request_id}: {end} tokens in {num_blocks} blocks")


def _check_drafts(
    request_id: str, drafts: list[int], slots: int, num_new: int, limits: PlanLimits
) -> None:
    """A row's draft slots follow its one token, within the proposer's length; its drafts
    (rank 0's) fill some of them. Where they follow all of its known tokens is checked as
    the row is laid out (PreparedStep.add_row)."""
    if not slots:
        return
    if slots > limits.num_speculative_tokens or num_new != 1 + slots or len(drafts) > slots:
        raise PlanError(f"{request_id}: {slots} draft slots in a row of {num_new} tokens")
    _in_range(drafts, limits.vocab_size, f"{request_id}: draft token id")


def _in_range(ids: Iterable[int], size: int, what: str) -> None:
    bad = [i for i in ids if not 0 <= i < size]
    if bad:
        raise PlanError(f"{what} out of range [0, {size}): {bad[:3]}")
