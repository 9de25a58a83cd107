"""What the scheduler shows (a base of Scheduler): its stats for /metrics and admission
control, and the invariants the tests check after every call."""

from __future__ import annotations

from collections import Counter
from copy import copy

from services.scheduler.handover import Handovers
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from services.scheduler.scheduler_config import SchedulerConfig
from services.scheduler.speculation import SpecDecodeStats
from services.scheduler.waiting_queue import WaitingQueue
from shared.protocol import StatsSnapshot


class SchedulerView:
    # What Scheduler holds, as read here.
    config: SchedulerConfig
    kv: KVCacheManager
    handover: Handovers
    requests: dict[str, Request]
    waiting: WaitingQueue
    running: list[Request]
    _running_loras: Counter[int]
    spec_decode: SpecDecodeStats
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    device_busy_seconds: float
    expert_tokens: list[int]
    expert_ranks: list[int]

    def stats(self) -> StatsSnapshot:
        """The scheduler's gauges and counters."""
        return StatsSnapshot(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            device_busy_seconds=self.device_busy_seconds,
            num_blocks=self.config.num_blocks,
            max_model_len=self.config.max_model_len,
            num_waiting_tokens=self.waiting.num_tokens,
            max_queued_requests=self.config.max_queued_requests,
            max_queued_tokens=self.config.max_queued_tokens,
            spec_num_drafts=self.spec_decode.num_drafts,
            spec_num_draft_tokens=self.spec_decode.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_decode.num_accepted_tokens,
            spec_accepted_per_position=list(self.spec_decode.accepted_per_position),
            expert_tokens=self.expert_tokens,
            expert_ranks=self.expert_ranks,
            host_tier=self.kv.host_tier_stats(self.config.host_block_bytes),
            # A copy: a snapshot keeps its figures while the counts go on (StatsLog's rates).
            kv_transfer=copy(self.handover.stats) if self.config.kv_transfer else None,
        )

    def check_invariants(self) -> None:
        """What must hold between any two calls (the tests check it after each)."""
        self.kv.check_invariants()
        self.waiting.check_invariants()
        assert len(self.running) <= self.config.max_num_seqs
        loras = Counter(r.lora_id for r in self.running if r.lora_id)
        assert loras == self._running_loras, "the running adapters' counts drifted"
        assert len(loras) <= self.config.max_loras, "more adapters run than there are slots"
        assert {r.request_id for r in self.running} | {r.request_id for r in self.waiting} == set(
            self.requests
        ), "a live request is neither running nor waiting"
        for request in self.waiting:
            assert request.request_id not in self.kv.block_ids, "a waiting request holds blocks"
        for request in self.requests.values():
            assert request.num_pending_tokens >= 0, "more tokens reported than were in flight"
            assert request.num_computed_tokens <= request.num_scheduled_tokens_end, (
                "computed past the tokens known and in flight"
            )
