"""Every message that crosses a component boundary, as msgspec Structs.

The scheduler and the executor meet only through these types, whether they share a
process (offline generation) or talk over ZeroMQ (serving). Fields are appended,
never reordered; `PROTOCOL_VERSION` (base.py) changes when a message changes shape.

Import them from here; each module holds one conversation:
- base: the Struct every message derives from, and the errors and finish reasons requests carry;
- sampling: how a request samples and stops (SamplingParams, StructuredOutput);
- engine: requests into the scheduler, its plans to the executor, tokens back, outputs out;
- frontend: a frontend and its tokenizer workers (API requests, streamed text);
- lora: runtime LoRA adapter loads and unloads;
- status: heartbeats, exits, stats, KV events and the executor's readiness.
Below, the messages each socket accepts: one typed decoder each (shared.ipc.Decoder).
"""

from __future__ import annotations

from shared.protocol.base import (
    PROTOCOL_VERSION,
    ErrorKind,
    FinishReason,
    Message,
    NotFoundError,
    ParameterError,
    QueueFullError,
    RequestError,
)
from shared.protocol.engine import (
    AbortRequests,
    CachedRequestData,
    DeviceReady,
    EngineRequest,
    HostCopies,
    KVExport,
    KVImport,
    KVTransfer,
    LaunchStep,
    ModelRunnerOutput,
    NewRequestData,
    OutputBatch,
    PaddingStep,
    PromptLogprobs,
    RequestOutput,
    ResetRanks,
    SchedulerHello,
    SchedulerOutput,
    TokenLogprobs,
)
from shared.protocol.frontend import (
    ChatMessage,
    GenerateRequest,
    PromptTokenLogprob,
    TextDelta,
    TextDeltas,
    TokenizeRequest,
    TokenizeResult,
    TokenLogprob,
    ToolCallDelta,
    ToolCallMessage,
    ToolChoice,
    ToolDefinition,
    TopLogprob,
)
from shared.protocol.lora import (
    AddLoraAdapter,
    LoraAdapterAdded,
    LoraAdapterInfo,
    LoraAdapterListing,
    LoraAdapterRequest,
    LoraAdapterResult,
)
from shared.protocol.sampling import (
    SamplingParams,
    StructuredOutput,
)
from shared.protocol.status import (
    ComponentDown,
    ExecutorReady,
    ExecutorVersion,
    Heartbeat,
    HostTierStats,
    KvEventBatch,
    ReplicasDown,
    StatsSnapshot,
)
from shared.protocol.transfer import (
    CudaSlots,
    KVFetch,
    KVFetchReply,
    KVRelease,
    KVTransferStats,
)

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
ToRanks = SchedulerOutput | LaunchStep | ResetRanks | PaddingStep | AddLoraAdapter
FrontendToTokenizer = (
    GenerateRequest | TokenizeRequest | AbortRequests | LoraAdapterRequest | ReplicasDown
)
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

__all__ = [
    "PROTOCOL_VERSION",
    "AbortRequests",
    "AddLoraAdapter",
    "CachedRequestData",
    "ChatMessage",
    "ComponentDown",
    "CudaSlots",
    "DeviceReady",
    "EngineRequest",
    "ErrorKind",
    "ExecutorReady",
    "ExecutorVersion",
    "FinishReason",
    "FrontendToTokenizer",
    "GenerateRequest",
    "Heartbeat",
    "HostCopies",
    "HostTierStats",
    "KVExport",
    "KVFetch",
    "KVFetchReply",
    "KVImport",
    "KVRelease",
    "KVTransfer",
    "KVTransferStats",
    "KvEventBatch",
    "LaunchStep",
    "LoraAdapterAdded",
    "LoraAdapterInfo",
    "LoraAdapterListing",
    "LoraAdapterRequest",
    "LoraAdapterResult",
    "Message",
    "ModelRunnerOutput",
    "NewRequestData",
    "NotFoundError",
    "OutputBatch",
    "PaddingStep",
    "ParameterError",
    "PromptLogprobs",
    "PromptTokenLogprob",
    "QueueFullError",
    "ReplicasDown",
    "RequestError",
    "RequestOutput",
    "ResetRanks",
    "SamplingParams",
    "SchedulerHello",
    "SchedulerOutput",
    "SchedulerToTokenizer",
    "StatsSnapshot",
    "StructuredOutput",
    "TextDelta",
    "TextDeltas",
    "ToExecutor",
    "ToFrontend",
    "ToRanks",
    "ToScheduler",
    "TokenLogprob",
    "TokenLogprobs",
    "TokenizeRequest",
    "TokenizeResult",
    "ToolCallDelta",
    "ToolCallMessage",
    "ToolChoice",
    "ToolDefinition",
    "TopLogprob",
]
