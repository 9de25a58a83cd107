"""Every message that crosses a component boundary, as msgspec Structs.

The scheduler and the executor meet only through these types, whether they share a
process (offline generation) or talk over ZeroMQ (serving). Fields are appended,
never reordered; `PROTOCOL_VERSION` changes when a message changes shape.
"""

from __future__ import annotations

import enum

import msgspec

PROTOCOL_VERSION = 12


class Message(msgspec.Struct, gc=False):
    """The base of every message. NOTE: messages hold primitives, lists, dicts and other
    messages, never a reference back to themselves, so they cannot form a cycle; untracked by
    the garbage collector, the thousands the engine makes each step cost it nothing."""


class ParameterError(ValueError):
    """A request parameter is invalid; `param` names it (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message


class NotFoundError(ParameterError):
    """A request names something the server does not have (a model, a LoRA adapter)."""


class StructuredOutput(Message, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """What the output must match, enforced token by token (vLLM's StructuredOutputsParams).

    Exactly one of `json`, `json_object`, `regex`, `choice`, `grammar` is set.
    """

    json: str | None = None  # a JSON Schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # a Lark grammar (or GBNF, converted)
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens
    # The request field it came from ("response_format", "tools", ...), named in its errors.
    source: str = "structured_outputs"

    def validate(self) -> None:
        kinds = [self.json, self.json_object or None, self.regex, self.choice, self.grammar]
        _check(
            sum(k is not None for k in kinds) == 1,
            self.source,
            "set exactly one of json, json_object, regex, choice and grammar",
        )
        _check(self.choice is None or len(self.choice) > 0, self.source, "choice is empty")


class SamplingParams(Message, kw_only=True, omit_defaults=True):
    """How to pick tokens and when to stop. Defaults follow vLLM / OpenAI."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int | None = None  # keep the k most likely tokens; None keeps all
    min_p: float = 0.0  # drop tokens below min_p * p(most likely)
    seed: int | None = None  # per-request seed: same output whatever the batch
    presence_penalty: float = 0.0  # subtracted once for every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides (or multiplies) logits of seen tokens
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    logprobs: int | None = None  # number of top logprobs to return per token
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # EOS and stop_token_ids are masked before this many tokens
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    stop: list[str] = []  # stop strings, matched by the detokenizer
    skip_special_tokens: bool = True
    n: int = 1
    structured_output: StructuredOutput | None = None  # the output must match it
    # Logprobs of the prompt's tokens (each given the ones before it) and this many top
    # alternatives; the first token has none. Such a request reads no prefix cache.
    prompt_logprobs: int | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ParameterError naming the first invalid parameter."""
        _check(self.temperature >= 0.0, "temperature", "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k is None or self.top_k >= 1, "top_k", "must be >= 1 (or None)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be <= max_tokens",
        )
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", "must be >= 0")
        _check(
            self.prompt_logprobs is None or self.prompt_logprobs >= 0,
            "prompt_logprobs",
            "must be >= 0",
        )
        _check(self.n >= 1, "n", "must be >= 1")
        if self.structured_output is not None:
            self.structured_output.validate()
            # Once the grammar is complete only EOS is allowed, which min_tokens would forbid.
            _check(self.min_tokens == 0, "min_tokens", "cannot be combined with structured output")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            _check(not bad, "stop_token_ids", f"ids out of vocabulary: {bad[:5]}")
            bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size]
            _check(not bad, "logit_bias", f"ids out of vocabulary: {bad[:5]}")
            for name in ("logprobs", "prompt_logprobs"):
                value = getattr(self, name)
                _check(
                    value is None or value <= vocab_size,
                    name,
                    f"must be <= the vocabulary size ({vocab_size})",
                )

    def fan_out(self) -> list[SamplingParams]:
        """The parameters of the n completions of one prompt, each its own request.

        They must differ, seeded or not: a seeded request's k-th completion uses seed + k.
        """
        _check(self.n >= 1, "n", "must be >= 1")
        return [
            msgspec.structs.replace(
                self, n=1, seed=None if self.seed is None else self.seed + index
            )
            for index in range(self.n)
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty reads the tokens seen so far (not only how many there are)."""
        penalties = (self.repetition_penalty, self.frequency_penalty, self.presence_penalty)
        return penalties != (1.0, 0.0, 0.0)


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParameterError(param, message)


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queued-requests; the client should retry later."""


class ErrorKind(enum.StrEnum):
    """Why a request failed. The HTTP edge maps each kind to one status code."""

    INVALID_REQUEST = "invalid_request"  # the client's: a bad parameter or prompt (400)
    NOT_FOUND = "not_found"  # the client's: it names a model or adapter the server lacks (404)
    QUEUE_FULL = "queue_full"  # the waiting queue is full: retry later (429)
    UNAVAILABLE = "unavailable"  # the engine is starting, draining, or lost a component (503)
    INTERNAL = "internal"  # a fault in kvflow or the device (500)


class RequestError(Message, kw_only=True):
    """One request's error, as every message that can carry one nests it."""

    kind: ErrorKind
    message: str
    param: str | None = None  # the invalid request parameter, for INVALID_REQUEST

    @classmethod
    def of(cls, exc: Exception) -> RequestError:
        """The error an exception raised while handling a request stands for."""
        if isinstance(exc, NotFoundError):
            return cls(kind=ErrorKind.NOT_FOUND, message=str(exc), param=exc.param)
        if isinstance(exc, ParameterError):
            return cls(kind=ErrorKind.INVALID_REQUEST, message=str(exc), param=exc.param)
        if isinstance(exc, QueueFullError):
            return cls(kind=ErrorKind.QUEUE_FULL, message=str(exc))
        return cls(kind=ErrorKind.INTERNAL, message=f"{type(exc).__name__}: {exc}")

    @classmethod
    def unavailable(cls, reason: str) -> RequestError:
        return cls(kind=ErrorKind.UNAVAILABLE, message=reason)


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


# ---------------------------------------------------------------- requests in


class EngineRequest(Message, tag=True, kw_only=True):
    """A tokenized request, as the scheduler receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # with --scheduling-policy priority: lower runs first
    # The LoRA adapter it runs under, by the id it was registered with (0: the base model).
    lora_id: int = 0


class AbortRequests(Message, tag=True):
    request_ids: list[str]


# ---------------------------------------------------------------- LoRA adapters


class LoraAdapterInfo(Message, kw_only=True):
    """A LoRA adapter the server runs: requests name it as their `model`."""

    name: str
    lora_id: int  # >= 1, never reused while the schedulers run; the same on every replica
    path: str
    parent: str  # the base model it adapts, as /v1/models shows it


class LoraAdapterRequest(Message, tag=True, kw_only=True):
    """Load an adapter from `lora_path` under `lora_name`, or unload the adapter of that name
    (the API's /v1/load_lora_adapter and /v1/unload_lora_adapter). From a frontend to a
    tokenizer worker, which carries it out on every engine replica's scheduler in rounds
    (services/tokenizer/lora_fanout.py), with two more actions: "commit" (a load every replica
    holds may be named from now on) and "discard" (forget the load of `lora_id`)."""

    request_id: str
    action: str  # "load" | "unload"; to a scheduler also "commit" | "discard"
    lora_name: str
    lora_path: str | None = None  # for "load"
    # "load": the id to take the adapter under, given to every replica but the first, whose
    # scheduler names it (None). "commit", "discard": the load's. "unload" to every replica
    # but the first: the next id the first would give when it unloaded (its answer's
    # lora_id); an adapter of that name taken under that id or later is a newer load's, and
    # stays.
    lora_id: int | None = None


class LoraAdapterListing(Message, kw_only=True):
    """One engine replica's LoRA adapters, and when they last changed (see
    StatsSnapshot.lora_version)."""

    replica: int
    adapters: list[LoraAdapterInfo]
    version: int


class LoraAdapterResult(Message, tag=True, kw_only=True):
    """The answer to a LoraAdapterRequest: a scheduler's to a tokenizer worker, with its
    replica's adapters as they are now; the worker's to the frontend, with every replica's."""

    request_id: str
    error: RequestError | None = None
    lora_id: int | None = None  # the id a load took; from a scheduler, see the request's
    listings: list[LoraAdapterListing] = []


class AddLoraAdapter(Message, tag=True, kw_only=True):
    """The scheduler asks its executor to read and check an adapter and take it under an id."""

    lora_id: int
    name: str
    path: str


class LoraAdapterAdded(Message, tag=True, kw_only=True):
    """The executor's answer to AddLoraAdapter: None, or why the adapter cannot run."""

    lora_id: int
    error: str | None = None


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


class CachedRequestData(Message, kw_only=True):
    """A request the executor already holds: only what changed since the last step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


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

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class LaunchStep(Message, tag=True):
    """Launch plan `step` (with its addenda): the scheduler will not amend it any more."""

    step: int


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
    """Tokens sampled in one step, for the requests that reached the end of their input."""

    step: int
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = {}
    device_ms: float = 0.0  # how long the step kept the device busy (0 where not measured)
    prompt_logprobs: dict[str, PromptLogprobs] = {}  # for requests with prompt_logprobs


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


# ------------------------------------------------------ frontend <-> tokenizer pool


class ToolCallMessage(Message, kw_only=True):
    """A call an assistant message made, as a conversation sends it back."""

    id: str
    name: str
    arguments: str  # JSON text


class ChatMessage(Message):
    role: str
    content: str
    name: str | None = None  # the participant's name, where the chat template uses it
    tool_calls: list[ToolCallMessage] = []  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ToolDefinition(Message, kw_only=True):
    """A function the model may call (OpenAI's `tools[i].function`)."""

    name: str
    description: str | None = None
    parameters: str = "{}"  # its JSON Schema, as JSON text


class ToolChoice(enum.StrEnum):
    """How a chat's tool calls are read from its output."""

    AUTO = "auto"  # the model may call: the --tool-call-parser reads its format
    REQUIRED = "required"  # the output is a JSON array of {"name", "parameters"} (a grammar)
    FUNCTION = "function"  # the output is the arguments of the one named function (a grammar)


class GenerateRequest(Message, tag=True, kw_only=True):
    """An API request before tokenization; exactly one of the prompt fields is set."""

    request_id: str
    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    echo: bool = False  # return the prompt text (and its token ids) in the first delta
    arrival_time: float = 0.0
    priority: int = 0  # with --scheduling-policy priority: lower runs first
    tools: list[ToolDefinition] | None = None  # given to the chat template
    tool_choice: ToolChoice | None = None  # None: the output is read as text only
    tool_name: str | None = None  # with ToolChoice.FUNCTION: the function called
    parallel_tool_calls: bool = True  # False: one call at most (later ones are dropped)
    # Echo with max_tokens 0: the engine computes one token, which is dropped: the answer is
    # the prompt (with its logprobs) alone.
    prompt_only: bool = False
    lora_id: int = 0  # the LoRA adapter it runs under (0: the base model)


class TokenizeRequest(Message, tag=True, kw_only=True):
    """/tokenize (text or messages -> ids) and /detokenize (ids -> text)."""

    request_id: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    token_ids: list[int] | None = None
    add_special_tokens: bool = True
    tools: list[ToolDefinition] | None = None  # given to the chat template with messages


class TokenizeResult(Message, tag=True, kw_only=True):
    request_id: str
    token_ids: list[int] = []
    text: str = ""
    error: RequestError | None = None


class TopLogprob(Message, array_like=True):
    token_id: int
    token: str  # its text
    logprob: float


class TokenLogprob(Message, array_like=True):
    """A sampled token's logprob and rank with its text, and the top alternatives."""

    token_id: int
    token: str
    logprob: float
    rank: int  # 1 for the most likely token
    top: list[TopLogprob]


class ToolCallDelta(Message, kw_only=True, omit_defaults=True):
    """A piece of one tool call of a choice (OpenAI's `delta.tool_calls[i]`): the first piece
    of a call names it, the rest add to its arguments."""

    index: int  # the call's place in the choice's tool_calls
    id: str | None = None
    name: str | None = None
    arguments: str = ""  # a piece of the arguments' JSON text


class PromptTokenLogprob(Message, array_like=True):
    """A prompt token with its text and, past the first token, its logprob and alternatives."""

    token_id: int
    token: str
    logprob: float | None  # None for the first token: nothing comes before it
    rank: int | None
    top: list[TopLogprob]


class TextDelta(Message, tag=True, kw_only=True):
    """New text for one request, from its tokenizer worker to the frontend."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = []
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_text: str | None = None  # first delta of an echo request
    prompt_token_ids: list[int] | None = None  # first delta of an echo request
    error: RequestError | None = None  # with finish_reason ERROR
    tool_calls: list[ToolCallDelta] = []  # `text` is then the content beside them
    prompt_logprobs: list[PromptTokenLogprob] | None = None  # the first delta, when asked

    @classmethod
    def failure(cls, request_id: str, error: RequestError) -> TextDelta:
        """The last delta of a request that ended in an error."""
        return cls(
            request_id=request_id,
            text="",
            token_ids=[],
            finish_reason=FinishReason.ERROR,
            error=error,
        )


class TextDeltas(Message, tag=True):
    """One step's deltas for the requests a frontend sent one tokenizer worker: one message a
    step, not one a request, so a frontend that falls a few steps behind under hundreds of
    streams never fills the link (a full link stops its requests)."""

    deltas: list[TextDelta]


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


class ExecutorVersion(Message, tag="ExecutorReady"):
    """The part of ExecutorReady that every protocol version keeps: read on its own when the
    whole message does not decode, so an executor of another version is refused by name."""

    protocol_version: int


# ------------------------------------------------------------ what each socket receives
# One typed decoder per receiving socket (shared.ipc.Decoder); anything else is dropped.

ToScheduler = (
    EngineRequest
    | AbortRequests
    | LoraAdapterRequest
    | ExecutorReady
    | ModelRunnerOutput
    | DeviceReady
    | LoraAdapterAdded
)
ToExecutor = SchedulerOutput | LaunchStep | SchedulerHello | AddLoraAdapter
ToRanks = SchedulerOutput | LaunchStep | ResetRanks | AddLoraAdapter
FrontendToTokenizer = GenerateRequest | TokenizeRequest | AbortRequests | LoraAdapterRequest
SchedulerToTokenizer = OutputBatch | LoraAdapterResult
ToFrontend = (
    TextDelta
    | TextDeltas
    | TokenizeResult
    | LoraAdapterResult
    | Heartbeat
    | StatsSnapshot
    | ComponentDown
)
