"""kvflow's fixed tunables, in one place: how often things happen, how long to wait, and the
built-in limits that are not flags. Settings an operator changes are `Config` fields instead."""

# -- liveness: every process says it is alive; the frontend judges health from that
HEARTBEAT_INTERVAL_S = 0.5  # between heartbeats; --component-timeout is how long they may lapse
# A component whose heartbeat connection closed and that has not beaten again this long is
# gone (services/frontend/engine/liveness.py). A live process whose connection broke reconnects and
# beats within a second, or within ZMTP_HEARTBEAT_MS * 4 where the break went unnoticed (an
# impostor took its identity): a margin for a starved one besides.
RECONNECT_GRACE_S = 10.0
LINKS_REFRESH_S = 1.0  # between lookups of the frontends behind --frontend-address
MISSING_GRACE_S = 10.0  # a frontend missing from the lookups this long is gone
ZMTP_HEARTBEAT_MS = 1000  # a DEALER's connection that carries nothing for 3 of these reconnects
MAX_MESSAGE_BYTES = 64 << 20  # a larger message on any socket disconnects its sender
STATS_INTERVAL_S = 0.1  # between the scheduler's snapshots to the frontend (/metrics, admission)
STATS_LOG_INTERVAL_S = 10.0  # between the scheduler's one-line stats logs while it has work

# -- the supervisor (`kvflow serve`)
DEATH_GRACE_S = 2.0  # after a component died: time for in-flight requests to get their error
UNHEALTHY_LIMIT_S = 30.0  # /health failing this long after startup means a hung component

# -- the HTTP API
# A LoRA load or unload ends with an error if every replica has not answered in this long (the
# tokenizer worker carrying it out says which did not); a frontend waits a little longer, so
# that the worker's answer, not its own timeout, reaches the client.
LORA_LOAD_TIMEOUT_S = 300.0
LORA_ANSWER_MARGIN_S = 10.0
TOKENIZE_TIMEOUT_S = 30.0  # /tokenize and /detokenize wait this long for the tokenizer pool
QUEUE_FULL_RETRY_AFTER_S = 1  # the Retry-After of a 429: the queue moves within a second or two
SSE_KEEPALIVE_S = 15.0  # a stream silent this long gets a comment, so proxies keep it open
# A streaming client that takes no bytes for this long (its socket buffers full) has stopped
# reading: its stream is dropped and its requests aborted.
STREAM_SEND_TIMEOUT_S = 30.0
DRAIN_ERROR_GRACE_S = 2.0  # after the drain timeout: time for the cut requests' errors to go out

# -- the executor's memory
DEFAULT_CPU_KV_BYTES = 1 << 30  # the KV cache on CPU, unless --kv-cache-memory-bytes
# The CUDA graphs' activations and workspace (decode batches, mixed steps up to 512 tokens; all
# share one pool, sized by the largest), a loose bound.
CUDA_GRAPH_RESERVE_BYTES = 512 << 20
# Speculative decoding under load: a step's decode rows verify at most this many tokens (their
# own and their drafts). Below it a decode step reads the weights once whatever its size, so
# drafts cost little; above it the step turns compute-bound and each rejected draft costs as
# much as a token that counts. Each row gets an equal share (services/scheduler/speculation.py).
SPECULATION_TOKEN_CAP = 256
# The most steps a speculating request runs pipelined without drafts after its proposals found
# nothing, before it waits for a token to be proposed for again (scheduler/speculation.py): a
# wait costs the request one step's overlap, so at most one step in 17 is spent looking.
SPECULATION_BACKOFF_MAX = 16
