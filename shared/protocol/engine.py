"""Requests into the scheduler, its plans to the executor, the executor's sampled tokens back,
and each request's outputs out."""

from __future__ import annotations

from shared.protocol.base import FinishReason, Message, RequestError
from shared.protocol.sampling import SamplingParams

# ---------------------------------------------------------------- requests in


class KVTransfer(Message, kw_only=True):
    """Prefill/decode disaggregation (--prefill-replicas): a request's part in a handover.

    `export`: to a prefill engine: compute the prompt and the first token, then end, the
    prompt's full blocks kept for a decode engine to fetch (RequestOutput.handed_over).
    `source` >= 0: to a decode engine: the prefill replica whose executors hold the prompt's
    KV (the request's id names it there); the blocks it cannot fetch it computes again.
    """

    export: bool = False
    source: int = -1


class EngineRequest(Message, tag=True, kw_only=True):
    """A tokenized request, as the scheduler receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # with --scheduling-policy priority: lower runs first
    # The LoRA adapter it runs under, by the id it was registered with (0: the base model).
    lora_id: int = 0
    # Tokens it generated already (a prefill engine's first token): they count as outputs
    # (max_tokens, penalties, a grammar's state) and are not sent again.
    output_token_ids: list[int] = []
    kv_transfer: KVTransfer | None = None


class AbortRequests(Message, tag=True):
    request_ids: list[str]


# ---------------------------------------------------------- scheduler -> executor


class NewRequestData(Message, kw_only=True):
    """A request the executor has no state for: first scheduled, or resumed after preemption."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resumed after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix hits)
    lora_id: int = 0  # its LoRA adapter (0: the base model)
    # LongRoPE (Phi-3's long-context models): whether every token of it takes the long set of
    # frequencies (services/executor/layers/rotary.py)
    long_rope: bool = False


class CachedRequestData(Message, kw_only=True):
    """A request the executor already holds: only what changed since the last step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


class HostCopies(Message, kw_only=True):
    """KV blocks to move between the GPU and the prefix cache's host tier, offloads first:
    (GPU block, host slot) of blocks a plan evicted, then (host slot, GPU block) of the prefix
    hits it restores."""

    offloads: list[tuple[int, int]] = []
    onloads: list[tuple[int, int]] = []
    # The disk tier behind it (--kv-offloading-disk-path), run in this order: files to
    # delete (hashes), offloads to write through to disk as well (host slot, hash), and files
    # to read into host slots (hash, host slot), reported with the plan's step.
    disk_deletes: list[bytes] = []
    disk_stores: list[tuple[int, bytes]] = []
    disk_loads: list[tuple[bytes, int]] = []
    # Evicted blocks the host tier had no slot for, written to disk straight from the GPU:
    # (GPU block, hash), copied before the plan's forward pass, as offloads
    disk_direct: list[tuple[int, bytes]] = []


class KVExport(Message, array_like=True):
    """A prefill engine's request that hands over, whose prompt the plan's step completes: its
    prompt's full blocks, in order, to copy out after the forward pass and keep until a
    decode engine fetches them."""

    request_id: str
    block_ids: list[int]


class KVImport(Message, array_like=True):
    """A decode engine's request whose prompt blocks `first`, `first` + 1, ... come from the
    executors of prefill replica `source` (where they are the export of `request_id`) into
    `block_ids`, before the plan's forward pass."""

    request_id: str
    source: int
    first: int
    block_ids: list[int]


class SchedulerOutput(Message, tag=True, kw_only=True):
    """The plan of one step.

    NOTE: `num_scheduled_tokens` is ordered: the executor lays out the batch in this
    order. `finished_request_ids` lists requests whose state the executor must drop
    (finished, aborted or preempted) since the previous step.
    """

    step: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    finished_request_ids: list[str]
    # Rows to append to plan `step`, which the executor holds and has not launched yet: new
    # requests that arrived after the plan was sent (see DeviceReady).
    addendum: bool = False
    # Speculative decoding: how many drafts each request's row may verify after its one token
    # (its count in num_scheduled_tokens includes them: room in the budget and the blocks).
    # The executor proposes them when it lays the row out, once the steps before are in.
    draft_slots: dict[str, int] = {}
    # The drafts each row verifies, as rank 0 of the executor chose them: filled in by it for
    # the other ranks (empty as the scheduler sends a plan).
    spec_token_ids: dict[str, list[int]] = {}
    # The prefix cache's host tier (services/scheduler/host_tier.py): the copies the executor
    # makes before the step's forward pass.
    host_copies: HostCopies | None = None
    # Prefill/decode disaggregation (KVTransfer): blocks to hand over, and to fetch.
    kv_exports: list[KVExport] = []
    kv_imports: list[KVImport] = []

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class LaunchStep(Message, tag=True):
    """Launch plan `step` (with its addenda): the scheduler will not amend it any more."""

    step: int
    # Set by rank 0 in the launches it relays, with expert parallelism across replicas: each
    # replica's rows in this step, as the replicas told each other, and whether any replica's
    # step is mixed (services/executor/parallel/lockstep.py's Round)
    replica_rows: list[int] = []
    mixed: bool = False


class SchedulerHello(Message, tag=True):
    """A scheduler without an executor asks for one: the executor drops whatever it ran for
    another scheduler (another `session`) and answers with ExecutorReady(session=session).

    Sent again every second until answered, so a scheduler (re)started before or after the
    executor finds it; an executor answers a repeated hello of its own session again, and
    resets nothing for it.
    """

    session: int  # random, new each time a scheduler (re)starts or adopts a new executor


# ------------------------------------------- executor rank 0 -> the other ranks


class ResetRanks(Message, tag=True):
    """Rank 0 of a tensor-parallel executor dropped every request and step (a new scheduler,
    or a plan it could not run): every other rank does the same. Plans and launches reach the
    other ranks as the scheduler sent them (SchedulerOutput, LaunchStep), and the LoRA adapters
    rank 0 took (AddLoraAdapter)."""


class PaddingStep(Message, tag=True):
    """With expert parallelism across replicas, rank 0 runs a step of padding rows alone (its
    replica has nothing to launch while others do: services/executor/parallel/lockstep.py):
    every other rank does the same, the replicas' rows in this step being `replica_rows`
    (`mixed`: another replica's step is mixed)."""

    replica_rows: list[int]
    mixed: bool = False


# ---------------------------------------------------------- executor -> scheduler


class DeviceReady(Message, tag=True):
    """The device is about to run out of launched work (the last step launched has finished
    its forward pass, or none is in flight): the next plan should launch now.

    Why the scheduler says when, not the executor: until then it may still append requests
    that arrived meanwhile to that plan (`SchedulerOutput.addendum`), so a prompt that comes
    in while step k runs is computed in step k+1, not one pipelined step later in k+2. The
    round trip is hidden behind the end of the step (its lm_head and sampling).
    """


class TokenLogprobs(Message, array_like=True):
    """Logprob of the sampled token, its rank, and the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(Message, array_like=True):
    """Logprobs of a run of prompt tokens, computed by one step (one prompt chunk)."""

    start: int  # the prompt position of the first entry's token (>= 1)
    entries: list[TokenLogprobs]


class ModelRunnerOutput(Message, tag=True, kw_only=True):
    """Tokens sampled in one step, for the requests that reached the end of their input: one
    each, or with speculative decoding the drafts accepted and the token after them."""

    step: int
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = {}  # one per sampled token
    device_ms: float = 0.0  # how long the step kept the device busy (0 where not measured)
    prompt_logprobs: dict[str, PromptLogprobs] = {}  # for requests with prompt_logprobs
    embeddings: dict[str, list[float]] = {}  # pooled prompts, for requests with embed
    # Speculative decoding: how many drafts each row verified (of its draft_slots; sampled
    # holds those accepted and the token after them).
    num_drafts: dict[str, int] = {}
    # A mixture of experts' load, at most once a second (else empty): each expert's choices
    # by real tokens since start, every layer's added up, and the rank holding each expert
    # whole (--enable-expert-parallel) or -1 (every rank holds a part of it)
    expert_tokens: list[int] = []
    expert_ranks: list[int] = []
    # The requests whose KVImport failed (the prefill engine gone, or its export dropped):
    # their rows ran on blocks that hold nothing, and their tokens are void.
    kv_import_failed: list[str] = []
    kv_import_seconds: float = 0.0  # the host's time fetching and copying the step's imports
    # The plan's disk loads (HostCopies.disk_loads) by hash: read into their host slots, or
    # not (a missing or corrupted file: a miss)
    disk_loaded: list[bytes] = []
    disk_load_failed: list[bytes] = []
    # The disk tier's I/O threads' time on files since the executor started (seconds)
    disk_read_seconds: float = 0.0
    disk_write_seconds: float = 0.0


# ------------------------------------------------------------- outputs out


class RequestOutput(Message, tag=True, kw_only=True):
    """What one step produced for one request: new tokens and, at the end, why it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = []
    finish_reason: FinishReason | None = None
    error: RequestError | None = None  # with finish_reason ERROR
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # With the first output of a request with prompt_logprobs: prompt tokens 1..n-1.
    prompt_logprobs: list[TokenLogprobs] = []
    embedding: list[float] | None = None  # with the output of a request with embed
    # A prefill engine's request (KVTransfer.export) that ends here and goes on in a decode
    # engine: its finish_reason is not the request's.
    handed_over: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failure(cls, request_id: str, error: RequestError, num_prompt_tokens: int) -> RequestOutput:
        """The last output of a request that ended in an error."""
        return cls(
            request_id=request_id,
            new_token_ids=[],
            finish_reason=FinishReason.ERROR,
            error=error,
            num_prompt_tokens=num_prompt_tokens,
        )


class OutputBatch(Message, tag=True):
    """One scheduler step's outputs for the requests of one tokenizer worker."""

    outputs: list[RequestOutput]
