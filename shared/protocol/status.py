"""What components say about themselves: heartbeats, exits, the scheduler's stats and KV
events, and the executor's readiness."""

from __future__ import annotations

import msgspec

from shared.protocol.base import PROTOCOL_VERSION, Message
from shared.protocol.lora import LoraAdapterInfo
from shared.protocol.transfer import KVTransferStats

# ------------------------------------------------- scheduler -> routers (KV events)


class KvEventBatch(Message, tag=True, kw_only=True):
    """What a scheduler's prefix cache gained and lost since its last batch, and its load now,
    published on --kv-events-address for routers (kvflow's own, or another that reads
    msgpack). Block keys are those of shared/block_hashes.py: a router computes a prompt's
    keys and sees how much of it each engine holds."""

    replica: int  # the engine's data-parallel rank
    session: int  # random per engine: a new one means every key heard before is gone
    seq: int  # 0, 1, ... within a session: a gap means batches were lost
    block_size: int
    stored: list[bytes]  # keys now cached
    removed: list[bytes]  # keys evicted
    num_running: int
    num_waiting: int
    kv_usage: float  # referenced blocks / all blocks
    queue_full: bool = False  # its waiting queue takes no new request now
    # Unfinished requests by the tokenizer worker they came from (its name): a worker tells
    # the other workers' share from its own in the same snapshot
    num_by_worker: dict[str, int] = {}


# ------------------------------------------------------------ health and stats


class Heartbeat(Message, tag=True, kw_only=True):
    """Every component says it is alive, from a thread, a few times a second."""

    component: str  # "scheduler", "executor-0", "tokenizer-1", ...
    pid: int
    sent_at: float
    protocol_version: int = PROTOCOL_VERSION
    session: str = ""  # random per process: the same name with a new session is a restart
    draining: bool = False  # a tokenizer worker finishing its requests before it exits
    # Why the process's main loop is stuck while this thread still beats (a step that has run
    # past --engine-stall-timeout); None while it makes progress. The process exits soon after.
    stalled: str | None = None


class ComponentDown(Message, tag=True):
    """The launcher saw a component's process exit."""

    component: str
    exit_code: int


class ReplicasDown(Message, tag=True):
    """A frontend to its tokenizer workers, whenever the set changes: the engine replicas
    (--data-parallel-size above 1) with a component gone, exited or stuck, and why. A worker
    ends the requests it placed on a replica that is newly in the set with an error, and
    places nothing on any replica in it until a later message leaves it out."""

    replicas: dict[int, str]


class HostTierStats(Message, kw_only=True):
    """The prefix cache's host tier (--kv-offloading-size), totals since start: prompt tokens
    looked up there (past the GPU's hits) and restored from it, and blocks copied each way."""

    num_blocks: int
    block_bytes: int  # a block's KV, every layer and rank
    queries: int = 0
    hits: int = 0
    blocks_to_host: int = 0
    blocks_to_gpu: int = 0
    # The disk tier behind it (--kv-offloading-disk-path; num_disk_blocks 0: none): blocks
    # written through to disk, read back into the host tier, and reads that found no good
    # file (missing or corrupted: misses)
    num_disk_blocks: int = 0
    blocks_to_disk: int = 0
    blocks_from_disk: int = 0
    disk_misses: int = 0
    disk_read_seconds: float = 0.0  # the executor's time reading and writing files
    disk_write_seconds: float = 0.0


class StatsSnapshot(Message, tag=True, kw_only=True):
    """The scheduler's gauges and counters, for /metrics and admission control."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    device_busy_seconds: float  # summed over steps, so busy fraction = its rate
    num_blocks: int
    replica: int = 0  # the engine replica (--data-parallel-size) it describes
    max_model_len: int
    # The waiting queue's exact size and bounds: a frontend refuses new requests up front, before
    # any tokenization, while it is full (the scheduler still checks each request exactly).
    num_waiting_tokens: int = 0
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None
    # The LoRA adapters requests may name on this replica, and when they last changed
    # (wall-clock ns, newer under a restarted scheduler): a frontend keeps each replica's newest
    # list, as a load's answer (LoraAdapterResult) may overtake the snapshot before it.
    lora_adapters: list[LoraAdapterInfo] = []
    lora_version: int = 0
    # Speculative decoding, totals since start (vLLM's spec_decode counters): rows that
    # verified drafts, their drafts, those accepted, and those accepted at each position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
    # A mixture of experts' load: each expert's choices since start, and its rank (or -1)
    expert_tokens: list[int] = []
    expert_ranks: list[int] = []
    host_tier: HostTierStats | None = None  # the prefix cache's, with --kv-offloading-size
    kv_transfer: KVTransferStats | None = None  # with --prefill-replicas

    @property
    def queue_full(self) -> str | None:
        """Why the waiting queue takes no new request now, or None."""
        if self.max_queued_requests is not None and self.num_waiting >= self.max_queued_requests:
            return f"{self.num_waiting} requests are waiting (--max-queued-requests)"
        if self.max_queued_tokens is not None and self.num_waiting_tokens >= self.max_queued_tokens:
            return f"{self.num_waiting_tokens} prompt tokens are waiting (--max-queued-tokens)"
        return None


class ExecutorReady(Message, tag=True, kw_only=True):
    """The executor loaded the model: the facts and limits the scheduler is built from.

    Only the executor reads model files; the scheduler takes the vocabulary, EOS ids and
    context length from here, and refuses to start if its own flags disagree with the limits
    the executor sized its buffers, graphs and KV cache for.
    """

    protocol_version: int
    model_name: str
    vocab_size: int
    eos_token_ids: list[int]
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # The SchedulerHello answered; None: sent unasked when the executor starts, which tells a
    # running scheduler that its executor was replaced (see services/scheduler/process.py).
    session: int | None = None
    max_loras: int = 0  # distinct LoRA adapters one step may run (0: LoRA is off)
    lora_modules: list[str] = []  # the names of its --lora-modules adapters, ids 1, 2, ...
    # Drafts its proposer guesses a step, at most (0: no speculative decoding).
    num_speculative_tokens: int = 0
    # Blocks of the prefix cache's host tier it holds (--kv-offloading-size; 0: none), and
    # the bytes a block takes there, every layer and rank.
    num_host_blocks: int = 0
    host_block_bytes: int = 0
    # The disk tier behind it (--kv-offloading-disk-path): the blocks it may hold, and the
    # hashes its directory holds from before (a restart), least recently written first
    num_disk_blocks: int = 0
    disk_blocks: list[bytes] = []
    # LongRoPE (Phi-3's long-context models): the original context, past which a request is
    # computed with the long set of frequencies from its start (None: not LongRoPE)
    long_rope_after: int | None = None
    # Each layer group's sliding window (None: full attention), behind which a request's
    # blocks return to the pool (shared/kv_groups.py, services/scheduler/kv_cache_manager.py)
    kv_windows: list[int | None] = msgspec.field(default_factory=lambda: [None])


class ExecutorVersion(Message, tag="ExecutorReady"):
    """The part of ExecutorReady that every protocol version keeps: read on its own when the
    whole message does not decode, so an executor of another version is refused by name."""

    protocol_version: int
