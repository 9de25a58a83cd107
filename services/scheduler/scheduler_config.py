"""What the scheduler is built from: the executor's limits (blocks, lengths, batch sizes) and
the operator's policies (prefix caching, chunked prefill, queue limits, LoRA slots)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None
    max_queued_requests: int | None = None  # waiting requests beyond which new ones are refused
    max_queued_tokens: int | None = None  # waiting tokens beyond which new ones are refused
    scheduling_policy: str = "fcfs"  # or "priority" (see WaitingQueue)
    max_loras: int = 0  # LoRA adapters among the running requests at once (0: LoRA is off)
    kv_events: bool = False  # record the prefix cache's changes (`Scheduler.block_events`)
    # Speculative decoding: drafts the executor proposes a step, at most (0: none).
    num_speculative_tokens: int = 0
    # KV slots past a speculating request's tokens its blocks hold for the next proposal (a
    # draft model's: shared/speculative.py, SpeculativeConfig.lookahead).
    num_lookahead_tokens: int = 0
    # The prefix cache's host tier (--kv-offloading-size): blocks it holds (0: none).
    num_host_blocks: int = 0
    host_block_bytes: int = 0  # a block's KV there, every layer and rank (for the metrics)
    # The disk tier behind it (--kv-offloading-disk-path): blocks it holds (0: none), and the
    # hashes its directory kept from before, least recently written first
    num_disk_blocks: int = 0
    disk_blocks: tuple[bytes, ...] = ()
    kv_transfer: bool = False  # a replica of a disaggregated server (--prefill-replicas)
    # LongRoPE: the original context, past which a request takes the long set of frequencies
    # from its start (services/executor/layers/rotary.py); None: not LongRoPE
    long_rope_after: int | None = None
    # Each layer group's sliding window (None: full attention), behind which a request's
    # blocks return to the pool (shared/kv_groups.py, services/scheduler/kv_cache_manager.py)
    kv_windows: tuple[int | None, ...] = (None,)
