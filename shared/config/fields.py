"""`ConfigFields`: every field kvflow is configured by, documented, in the order --help lists
them; `Config` (config.py) adds the checks made when one is built.

The fields are grouped by their flags' group (the `-- model`, `-- lora`, ... comments; the
first four groups' in engine_fields.py); each group's checks are in validation.py, and what
sets the values in sources.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Self

from shared.config.engine_fields import EngineFields
from shared.config.options import option

# services/tokenizer/tool_parsers: vLLM's names
TOOL_CALL_PARSERS = (
    "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "granite", "phi4_mini_json",
    "openai",
)  # fmt: skip


@dataclass(frozen=True)
class ConfigFields(EngineFields):
    """Everything one kvflow process is configured by, whole: a process hands it on as a JSON
    file (`config_from_file`), never pickled. Built as a `Config`, which checks it."""

    # -- scheduler
    max_num_seqs: int = option(256, "scheduler", "Most requests in one step.")
    max_num_batched_tokens: int = option(
        2048,
        "scheduler",
        "Most tokens in one step (token budget); offline (`LLM`, `generate`, `bench`) and for"
        " an embedding model (--task embed) the default is 16384, as vLLM's LLM class on large"
        " GPUs.",
    )
    enable_chunked_prefill: bool = option(
        True, "scheduler", "Split long prompts across steps to fit the token budget."
    )
    scheduling_policy: str = option(
        "fcfs",
        "scheduler",
        "Order of waiting requests: fcfs (arrival), or priority (a request's `priority`, lower"
        " first, then arrival; the lowest is preempted first).",
        ("fcfs", "priority"),
    )
    speculative_config: str | None = option(
        None,
        "scheduler",
        "Speculative decoding, as a JSON object with vLLM's keys: method ngram (prompt lookup:"
        " the tokens that followed the last prompt_lookup_max..prompt_lookup_min tokens where"
        " they occurred before in the request), suffix (suffix decoding, over recent outputs"
        " too), draft_model (model: a smaller model of the same tokenizer drafts) or eagle3"
        " (model: an EAGLE-3 head's folder, the published format),"
        " num_speculative_tokens (drafts verified a step). Output is what it would be"
        " without: greedy token for token, sampled in"
        ' distribution. E.g. \'{"method": "ngram", "num_speculative_tokens": 4,'
        ' "prompt_lookup_max": 4, "prompt_lookup_min": 2}\'.',
    )
    # -- server
    host: str = option("127.0.0.1", "server", "HTTP address to listen on (0.0.0.0 for all).")
    port: int = option(8000, "server", "HTTP port.")
    api_key: str | None = option(
        None,
        "server",
        "Require this bearer token on every route but /health and /ready; several may be given"
        " comma-separated.",
        secret=True,
    )
    api_key_file: str | None = option(
        None,
        "server",
        "Also accept the keys in this file, one per line (blank lines and # comments ignored).",
    )
    metrics_without_auth: bool = option(
        False, "server", "Serve /metrics without the API key (for Prometheus scrapers)."
    )
    served_model_name: str | None = option(
        None, "server", "The model name the API shows and accepts; default: the model's."
    )
    tokenizer_pool_size: int = option(
        2,
        "server",
        "Tokenizer worker processes `serve` starts (run apart, the pool is whoever joins).",
    )
    api_server_count: int | None = option(
        None,
        "server",
        "Frontend processes `serve` starts, all taking connections on --port (the kernel "
        "spreads them evenly); default: two per engine replica with --data-parallel-size, "
        "else one. One streams up to about 25,000 tokens a second.",
    )
    max_queued_requests: int = option(
        4096, "server", "Requests waiting for the engine before new ones get 429."
    )
    max_queued_tokens: int | None = option(
        1 << 20,
        "server",
        "Prompt tokens waiting for the engine before new requests get 429 (an empty queue"
        " takes any request); none: no bound.",
    )
    request_timeout: float | None = option(
        None,
        "server",
        "Seconds a generate request may run (a request's `timeout` may ask for less) before it"
        " ends with an error; none: no limit.",
    )
    drain_timeout: float = option(
        30.0, "server", "On SIGTERM, seconds to let in-flight requests finish before exiting."
    )
    disable_log_stats: bool = option(
        False, "server", "Do not log the engine's throughput, queue and KV usage every 10 s."
    )
    enable_log_requests: bool = option(
        False, "server", "Log one line per API request (route, status, tokens, duration)."
    )
    enable_tokenizer_info_endpoint: bool = option(
        False,
        "server",
        "Serve GET /tokenizer_info: the tokenizer's configuration, chat template included "
        "(off by default, as in vLLM: a template may be private).",
    )
    enable_auto_tool_choice: bool = option(
        False,
        "server",
        "Let the model decide when to call tools (`tool_choice: auto`); needs --tool-call-parser.",
    )
    responses_store_size: int = option(
        1000,
        "server",
        "Finished /v1/responses responses (store: true) each frontend keeps for "
        "previous_response_id and GET /v1/responses/{id}; the oldest go first. 0 keeps none.",
    )
    disable_additional_properties: bool = option(
        True,
        "server",
        "Structured output is strict, as OpenAI's strict mode and vLLM's default (xgrammar) "
        "backend: an object schema that does not say additionalProperties admits only its listed "
        "properties (in response_format and every tool's parameters), and generated JSON has at "
        "most one space between tokens. --no-disable-additional-properties lets such objects "
        "take any other keys and JSON be pretty-printed (tool arguments stay compact).",
    )
    tool_call_parser: str | None = option(
        None,
        "server",
        "How tool calls are read from the model's output with `tool_choice: auto`: hermes "
        "(Qwen2.5, Qwen3, Hermes: <tool_call> JSON blocks), llama3_json (Llama 3.1/3.2 JSON), "
        "mistral (Mistral, Mixtral, Devstral: [TOOL_CALLS]), qwen3_coder (Qwen3-Coder: "
        "<function=...> XML), pythonic (Llama 3.2/4, Gemma 3 pythonic: [f(x=1)]), granite "
        "(Granite 3: <|tool_call|>[...]), phi4_mini_json (Phi-4-mini: functools[...]) or openai "
        "(gpt-oss: harmony's messages to functions; with --reasoning-parser openai_gptoss).",
        TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = option(
        None,
        "server",
        "How a chat's thinking is read apart from its answer (`reasoning_content`): qwen3 "
        "(Qwen3: <think>...</think>, none when thinking is off), deepseek_r1 (DeepSeek R1, "
        "QwQ: the output starts inside <think>) or openai_gptoss (gpt-oss: harmony's analysis "
        "channel).",
        ("deepseek_r1", "qwen3", "openai_gptoss"),
    )
    # -- limits: what one request may ask for (400 or 413 naming the limit beyond)
    max_request_body_bytes: int = option(8 << 20, "limits", "Larger request bodies get 413.")
    max_num_messages: int = option(1024, "limits", "Most chat messages in one request.")
    max_num_prompts: int = option(1024, "limits", "Most prompts in one completions request.")
    max_prompt_chars: int = option(
        1 << 21, "limits", "Longest prompt or message text, in characters (before tokenizing)."
    )
    max_n: int = option(16, "limits", "Most completions per prompt (`n`).")
    max_tokens_limit: int | None = option(
        None, "limits", "Largest `max_tokens` a request may ask for; none: up to max_model_len."
    )
    max_logprobs: int = option(20, "limits", "Largest `logprobs` / `top_logprobs`.")
    max_stop_strings: int = option(16, "limits", "Most stop strings in one request.")
    max_stop_string_chars: int = option(256, "limits", "Longest stop string, in characters.")
    max_logit_bias: int = option(1024, "limits", "Most `logit_bias` entries in one request.")
    grammar_compile_timeout: float = option(
        10.0,
        "limits",
        "Seconds a structured output's grammar (JSON Schema, regex, grammar, tools) may take "
        "to compile; longer ones get 400.",
    )
    # -- components (addresses for running them apart; `serve` picks private ipc:// ones)
    frontend_address: str | None = option(
        None,
        "components",
        "ZMQ address the frontend binds (e.g. tcp://0.0.0.0:5557); the other components report"
        " to every frontend it names: a comma list, or a host name resolving to several.",
    )
    scheduler_address: str | None = option(
        None,
        "components",
        "ZMQ address the scheduler binds (e.g. tcp://0.0.0.0:5558); with several engine "
        "replicas, a comma list of one per replica, in replica order.",
    )
    data_parallel_rank: int | None = option(
        None,
        "components",
        "The engine replica this scheduler or executor is (default 0): it binds or connects to "
        "that entry of --scheduler-address and --kv-events-address.",
    )
    data_parallel_group: str | None = option(
        None,
        "components",
        "A folder on this host that every engine replica's executors reach: with "
        "--data-parallel-size and --enable-expert-parallel they meet there to spread a "
        "mixture of experts' experts over all their ranks (serve and LLM make a private one).",
    )
    kv_events_address: str | None = option(
        None,
        "components",
        "ZMQ address the scheduler binds to publish its prefix cache's events (block keys "
        "cached and evicted, and its load) for routers, e.g. tcp://0.0.0.0:5559: msgpack "
        "KvEventBatch frames on a PUB socket. With several engine replicas, a comma list of one "
        "per replica; the tokenizer workers route by them.",
    )
    kv_transfer_address: str | None = option(
        None,
        "components",
        "With --prefill-replicas: ZMQ address where each replica's executor serves the KV it"
        " hands over, a comma list of one per replica (e.g. tcp://10.0.0.5:5560); tensor-"
        "parallel rank r binds the port + r (tcp) or the name with -r (ipc).",
    )
    worker_index: int | None = option(
        None,
        "components",
        "Name this tokenizer worker tokenizer-<index>; default: after its host and process, so"
        " replicas (compose --scale, Kubernetes) need none.",
    )
    ready_file: str | None = option(
        None,
        "components",
        "A tokenizer worker or frontend creates this file once it takes requests (a readiness"
        " probe).",
    )
    listen_fd: int | None = option(
        None,
        "components",
        "A listening socket (its file descriptor) the frontend takes HTTP connections from, as"
        " serve hands one to each of its --api-server-count frontends, instead of binding "
        "--host and --port.",
    )
    metrics_share_dir: str | None = option(
        None,
        "components",
        "A folder where frontends run side by side (--api-server-count) share their request "
        "metrics: each writes its own there every second, and /metrics on any counts them all.",
    )
    component_timeout: float = option(
        60.0,
        "components",
        "Seconds without a heartbeat before a component whose connection is still open counts"
        " as dead (one that exits or disconnects counts at once; a slow one is not dead).",
    )
    engine_stall_timeout: float = option(
        120.0,
        "components",
        "Seconds an engine step (or the scheduler's loop) may make no progress: then requests"
        " in flight fail, /health turns 503 and the stuck process exits, so it is restarted.",
    )
    allow_remote_components: bool = option(
        False,
        "components",
        "Let components bind a non-loopback tcp:// address (use --curve-key-dir across hosts).",
    )
    curve_key_dir: str | None = option(
        None,
        "components",
        "Folder of ZeroMQ CURVE keys (`kvflow keys DIR` makes them): every socket is then"
        " authenticated and encrypted, and only holders of the keys may connect.",
    )
    fault_hang_step: int | None = option(
        None,
        "components",
        "Testing only: the executor's step N never ends (its heartbeats go on), to exercise"
        " --engine-stall-timeout.",
    )
    startup_timeout: float = option(
        900.0,
        "components",
        "Seconds to load the model and start every component before startup counts as failed.",
    )
    # -- device
    device: str = option("auto", "device", "Where the model runs.", ("auto", "cpu", "cuda"))
    enforce_eager: bool = option(
        False, "device", "Run every step eagerly: no CUDA graphs for decode (CUDA only)."
    )
    disable_pdl: bool = option(
        False,
        "device",
        "Launch the decode path's Triton kernels the ordinary way, each after the previous one"
        " ends, instead of with programmatic dependent launch (Hopper and later GPUs).",
    )
    batch_invariant: bool = option(
        False,
        "device",
        "Decode steps of up to 16 query rows compute each row as a step of one row would, so"
        " that greedy speculative decoding at batch 1 gives the tokens decoding without it"
        " gives (vLLM's VLLM_BATCH_INVARIANT, for those steps; bf16/fp16 dense models at"
        " --tensor-parallel-size 1, without LoRA or sliding windows).",
    )
    log_level: str = option(
        "info", "device", "Logging level.", ("debug", "info", "warning", "error")
    )

    def __post_init__(self) -> None:
        """Config's checks (config.py); the generated __init__ calls this hook."""

    @property
    def replica(self) -> int:
        """This scheduler's or executor's engine replica (--data-parallel-rank)."""
        return self.data_parallel_rank or 0

    @property
    def frontends(self) -> int:
        """How many frontends `serve` starts: --api-server-count, or by default two per engine
        replica with --data-parallel-size (two H200s serving an 8B model at DP=2 stalled
        streams with two frontends, each at a full core, and not with four), else one, as where
        --frontend-address names its one address."""
        if self.api_server_count is not None:
            return self.api_server_count
        if self.data_parallel_size == 1 or self.frontend_address is not None:
            return 1
        return 2 * self.data_parallel_size

    def addresses(self, name: str) -> list[str]:
        """A comma-list address field's entries (scheduler_address, kv_events_address)."""
        value: str | None = getattr(self, name)
        return [a.strip() for a in (value or "").split(",") if a.strip()]

    def replica_address(self, name: str) -> str | None:
        """This replica's entry of a comma-list address field, or None if it is unset."""
        entries = self.addresses(name)
        return entries[self.replica] if entries else None

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)


def field_doc(name: str) -> str:
    """A Config field's help text (for positional arguments, which have no generated flag)."""
    doc: str = ConfigFields.__dataclass_fields__[name].metadata["doc"]
    return doc
