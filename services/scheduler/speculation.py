"""The scheduler's side of speculative decoding: how many drafts a step's rows may verify, and
the counts behind vLLM's spec_decode metrics.

A speculating request's decode row has room for its token and up to `draft_slots` drafts
after it (lookahead slots in the token budget and in its blocks). The executor proposes the
drafts when it lays the row out, once the steps before it are in, so the row is planned like
any other, pipelined. The step returns the drafts the target agreed with and the target's
token after them, so the request moves 1..k+1 tokens. Until a step is reported the scheduler
counts it as bringing all it may (`num_pending_tokens`, `num_computed_tokens`: upper bounds)
and then takes back what it did not: the drafts rejected, or never proposed. Their KV is past
the request's computed tokens, written over when the row gets that far again.

A row with draft slots waits on the executor for the step before it (its drafts are proposed
from that step's tokens), which costs the device the pipelined loop's overlap of one step's
host work with the last step's device work. Where the proposer finds nothing, that wait buys
nothing: after a row that had slots and verified no drafts, the request's rows get no slots
for 2, 4, 8, then 16 steps (SPECULATION_BACKOFF_MAX); drafts verified start it over
(note_proposal).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from services.scheduler.scheduler_config import SchedulerConfig
from shared.constants import SPECULATION_BACKOFF_MAX, SPECULATION_TOKEN_CAP
from shared.protocol import CachedRequestData


def drafts_per_row(num_speculating: int) -> int:
    """The drafts each speculating row may verify in a step of `num_speculating` such rows,
    under load: an equal share of SPECULATION_TOKEN_CAP, each row's own token included (256
    tokens: 4 drafts a row up to 51 rows, 1 from 86 to 128, none from 129 on)."""
    return max(0, SPECULATION_TOKEN_CAP // max(num_speculating, 1) - 1)


def draft_room(request: Request, config: SchedulerConfig, budget: int) -> int:
    """How many drafts the request's next row may verify with `budget` tokens left once its
    own is paid for: none past its length limits, where no token could be kept, counting
    the tokens in flight as bringing all they may."""
    return max(
        0,
        min(
            budget,
            request.max_tokens - request.num_output_tokens - request.num_pending_tokens - 1,
            config.max_model_len - request.num_scheduled_tokens_end - 1,
        ),
    )


def add_draft_slots(
    kv: KVCacheManager,
    config: SchedulerConfig,
    placed: list[tuple[Request, CachedRequestData]],
    scheduled: dict[str, int],
    slots: dict[str, int],
    budget: int,
) -> None:
    """Room for drafts after each decode row of a speculating request (`placed`: the running
    rows of a plan; `scheduled` counts each row's slots too, `slots` holds them), from the
    budget and blocks that are left once every row of the plan is placed, new admissions
    included: never at the cost of a row or a preemption."""
    share = drafts_per_row(sum(r.speculates and not r.spec_skip for r, _ in placed))
    for request, data in placed:
        num_new = scheduled[request.request_id]
        if budget <= 0 or not decodes(request, num_new):
            continue
        row_slots = draft_slots(request, config, budget, share)
        if row_slots and grow(kv, request, data, num_new + row_slots):
            scheduled[request.request_id] += row_slots
            slots[request.request_id] = row_slots
            budget -= row_slots


def grow(kv: KVCacheManager, request: Request, data: CachedRequestData, num_new: int) -> bool:
    """Blocks for `num_new` tokens of the request's row from what the pool has left, added to
    the row's new blocks; False, taking none, where the pool has too few."""
    blocks = kv.block_ids[request.request_id]
    held = len(blocks)
    if not kv.allocate(request, num_new):
        return False
    data.new_block_ids.extend(blocks[held:])
    return True


def decodes(request: Request, num_new: int) -> bool:
    """Whether a row of `num_new` tokens is the request's decode: its one token to compute is
    its last (known or in flight), and it has sampled before."""
    return (
        num_new == 1
        and request.num_computed_tokens + 1 == request.num_scheduled_tokens_end
        and request.num_output_tokens + request.num_pending_tokens > 0
    )


def draft_slots(request: Request, config: SchedulerConfig, budget: int, share: int) -> int:
    """The drafts the request's decode row may verify this step: at most `share`
    (drafts_per_row) and num_speculative_tokens, none for a request that does not speculate
    or is in a back-off."""
    if not request.speculates or request.spec_skip:
        return 0
    return min(share, config.num_speculative_tokens, draft_room(request, config, budget))


def reserve_lookahead(
    kv: KVCacheManager,
    config: SchedulerConfig,
    request: Request,
    data: CachedRequestData,
    scheduled: dict[str, int],
) -> None:
    """Blocks for the KV slots that a speculating row's next proposal writes past its tokens
    (a draft model's), from what the pool has left once every row of the plan is placed:
    never at the cost of a row or a preemption (without them it drafts fewer). Called for
    each running row of a plan, after all are placed; `data` gets the blocks."""
    num_new = scheduled[request.request_id]
    end = request.num_computed_tokens + num_new
    lookahead = min(config.num_lookahead_tokens, config.max_model_len - end)
    if lookahead > 0 and request.speculates and end >= request.num_tokens:
        grow(kv, request, data, num_new + lookahead)


def note_proposal(request: Request, num_slots: int, num_verified: int) -> None:
    """After a reported row of a speculating request that had `num_slots` draft slots and
    verified `num_verified` drafts: count a miss where the proposer found nothing, or count
    down the back-off (see the module's docstring)."""
    if num_verified:
        request.spec_misses, request.spec_skip = 0, 0
    elif num_slots and not request.spec_skip:  # else planned before the back-off began
        request.spec_misses += 1
        request.spec_skip = min(2**request.spec_misses, SPECULATION_BACKOFF_MAX)
    else:
        request.spec_skip = max(request.spec_skip - 1, 0)


@dataclass
class SpecDecodeStats:
    """Totals since start, as vLLM's spec_decode counters count them."""

    num_drafts: int = 0  # rows that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying row moved on average: its accepted drafts and the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
