"""What the scheduler shows: its stats for /metrics and admission control, and the invariants
the tests check after every call."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from shared.protocol import StatsSnapshot

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler


def snapshot(scheduler: Scheduler) -> StatsSnapshot:
    """The scheduler's gauges and counters."""
    return StatsSnapshot(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        kv_usage=scheduler.kv.usage,
        prefix_cache_queries=scheduler.kv.prefix_queries,
        prefix_cache_hits=scheduler.kv.prefix_hits,
        num_preemptions=scheduler.num_preemptions,
        num_prompt_tokens=scheduler.num_prompt_tokens,
        num_generation_tokens=scheduler.num_generation_tokens,
        device_busy_seconds=scheduler.device_busy_seconds,
        num_blocks=scheduler.config.num_blocks,
        max_model_len=scheduler.config.max_model_len,
        num_waiting_tokens=scheduler.waiting.num_tokens,
        max_queued_requests=scheduler.config.max_queued_requests,
        max_queued_tokens=scheduler.config.max_queued_tokens,
        spec_num_drafts=scheduler.spec_decode.num_drafts,
        spec_num_draft_tokens=scheduler.spec_decode.num_draft_tokens,
        spec_num_accepted_tokens=scheduler.spec_decode.num_accepted_tokens,
        spec_accepted_per_position=list(scheduler.spec_decode.accepted_per_position),
        expert_tokens=scheduler.expert_tokens,
        expert_ranks=scheduler.expert_ranks,
        host_tier=scheduler.kv.host_tier_stats(scheduler.config.host_block_bytes),
        kv_transfer=scheduler.handover.stats if scheduler.config.kv_transfer else None,
    )


def check_scheduler(scheduler: Scheduler) -> None:
    """What must hold between any two calls (the tests check it after each)."""
    scheduler.kv.check_invariants()
    scheduler.waiting.check_invariants()
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    loras = Counter(r.lora_id for r in scheduler.running if r.lora_id)
    assert loras == scheduler._running_loras, "the running adapters' counts drifted"
    assert len(loras) <= scheduler.config.max_loras, "more adapters run than there are slots"
    assert {r.request_id for r in scheduler.running} | {
        r.request_id for r in scheduler.waiting
    } == set(scheduler.requests), "a live request is neither running nor waiting"
    for request in scheduler.waiting:
        assert request.request_id not in scheduler.kv.block_ids, "a waiting request holds blocks"
    for request in scheduler.requests.values():
        assert request.num_pending_tokens >= 0, "more tokens reported than were in flight"
        assert request.num_computed_tokens <= request.num_scheduled_tokens_end, (
            "computed past the tokens known and in flight"
        )
