"""The scheduler's side of speculative decoding: how many of a request's drafts a step verifies,
and the counts behind vLLM's spec_decode metrics.

A speculating request's row computes its last token and then its drafts (lookahead slots in
the token budget and in its blocks). The step returns the drafts the target agreed with and
the target's token after them, so the request moves 1..k+1 tokens, and the KV of the drafts it
rejected is past its computed tokens: written over when the row gets that far again.

Its drafts are proposed from the tokens of the step before, so a speculating request waits
for its token in flight: it runs every step whose plan is made after its last step was
collected, and loses the pipelined loop's overlap of one step's host work with the last
step's device work. Where the proposer finds nothing, that wait buys nothing: after a
proposal that found no drafts, the request runs pipelined, without drafts, for 2, 4, 8, then
16 steps (SPECULATION_BACKOFF_MAX) before it waits to be proposed for again; drafts found
start it over (note_proposal). The executor proposes only for requests with no step in flight.
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
    own are paid for: none past its length limits, where no token could be kept."""
    return max(
        0,
        min(
            budget,
            request.max_tokens - request.num_output_tokens - 1,
            config.max_model_len - request.num_tokens - 1,
        ),
    )


def take_drafts(request: Request, config: SchedulerConfig, budget: int, share: int) -> list[int]:
    """The drafts the request's row verifies this step, at most `share` (drafts_per_row);
    consumed: each set is verified once."""
    drafts, request.spec_token_ids = request.spec_token_ids, []
    return drafts[: min(share, draft_room(request, config, budget))]


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
        blocks = kv.block_ids[request.request_id]
        held = len(blocks)
        if kv.allocate(request, num_new + lookahead):
            data.new_block_ids.extend(blocks[held:])


def awaits_drafts(request: Request) -> bool:
    """Whether the request waits for its token in flight before its next step: it speculates
    and is not in a pipelined stretch after proposals that found nothing."""
    return request.speculates and request.num_pending_tokens > 0 and request.spec_skip == 0


def note_proposal(request: Request, drafts: list[int]) -> None:
    """Keep the drafts proposed with a step's tokens, or count a miss. Once the step's tokens
    are in: with none in flight the executor proposed for the request (found `drafts`, maybe
    none); with a step in flight it did not (any drafts would be for a token it has passed)."""
    if request.num_pending_tokens:
        request.spec_token_ids = []
        request.spec_skip = max(request.spec_skip - 1, 0)
    elif drafts:
        request.spec_token_ids, request.spec_misses, request.spec_skip = drafts, 0, 0
    else:
        request.spec_token_ids = []
        request.spec_misses += 1
        request.spec_skip = min(2**request.spec_misses, SPECULATION_BACKOFF_MAX)


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
