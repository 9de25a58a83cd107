"""The wire protocol: every message survives its socket's decoder; malformed frames are dropped."""

from __future__ import annotations

import logging

import msgspec
import pytest

from shared.ipc import Decoder, encode
from shared.protocol import (
    AbortRequests,
    CachedRequestData,
    ChatMessage,
    ComponentDown,
    DeviceReady,
    EngineRequest,
    ErrorKind,
    ExecutorReady,
    FinishReason,
    FrontendToTokenizer,
    GenerateRequest,
    Heartbeat,
    LaunchStep,
    ModelRunnerOutput,
    NewRequestData,
    OutputBatch,
    ParameterError,
    QueueFullError,
    RequestError,
    RequestOutput,
    SamplingParams,
    SchedulerHello,
    SchedulerOutput,
    SchedulerToTokenizer,
    StatsSnapshot,
    TextDelta,
    ToExecutor,
    ToFrontend,
    TokenizeRequest,
    TokenizeResult,
    TokenLogprob,
    TokenLogprobs,
    TopLogprob,
    ToScheduler,
)

PARAMS = SamplingParams(temperature=0.7, top_k=5, seed=3, stop=["\n"], logit_bias={7: -1.5})
ERROR = RequestError(kind=ErrorKind.INVALID_REQUEST, message="prompt: empty", param="prompt")
LOGPROBS = TokenLogprobs(
    token_id=5, logprob=-0.25, rank=1, top_token_ids=[5, 9], top_logprobs=[-0.25, -2.0]
)

# Each socket's union, and a message of every type it receives, with its fields filled.
MESSAGES = {
    ToScheduler: [
        EngineRequest(request_id="r", prompt_token_ids=[1, 2], sampling_params=PARAMS),
        AbortRequests(["r", "s"]),
        ExecutorReady(
            protocol_version=2,
            model_name="m",
            vocab_size=100,
            eos_token_ids=[2, 3],
            max_model_len=512,
            block_size=16,
            num_blocks=64,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            session=12345,
        ),
        ModelRunnerOutput(step=4, sampled={"r": [7]}, logprobs={"r": [LOGPROBS]}, device_ms=7.5),
        DeviceReady(),
    ],
    ToExecutor: [
        SchedulerOutput(
            step=4,
            new_requests=[
                NewRequestData(
                    request_id="r",
                    prompt_token_ids=[1, 2],
                    output_token_ids=[3],
                    sampling_params=PARAMS,
                    block_ids=[0, 5],
                    num_computed_tokens=16,
                )
            ],
            cached_requests=[
                CachedRequestData(request_id="s", new_block_ids=[9], num_computed_tokens=40)
            ],
            num_scheduled_tokens={"r": 3, "s": 1},
            finished_request_ids=["t"],
        ),
        LaunchStep(4),
        SchedulerHello(2**61 + 5),
    ],
    FrontendToTokenizer: [
        GenerateRequest(
            request_id="r",
            sampling_params=PARAMS,
            messages=[ChatMessage("user", "hé 🍕")],
            echo=True,
        ),
        TokenizeRequest(request_id="t", prompt="hi", add_special_tokens=False),
        AbortRequests(["r"]),
    ],
    SchedulerToTokenizer: [
        OutputBatch(
            [
                RequestOutput(request_id="r", new_token_ids=[7], new_logprobs=[LOGPROBS]),
                RequestOutput(
                    request_id="s", new_token_ids=[], finish_reason=FinishReason.ERROR, error=ERROR
                ),
            ]
        )
    ],
    ToFrontend: [
        TextDelta(
            request_id="r",
            text="🍕",
            token_ids=[7],
            logprobs=[TokenLogprob(7, "🍕", -0.1, 1, [TopLogprob(7, "🍕", -0.1)])],
            finish_reason=FinishReason.LENGTH,
            num_prompt_tokens=3,
            num_output_tokens=1,
        ),
        TextDelta.failure("s", RequestError.unavailable("the engine is still starting")),
        TokenizeResult(request_id="t", token_ids=[1, 2], text="hi"),
        TokenizeResult(request_id="u", error=ERROR),
        Heartbeat(component="scheduler", pid=12, sent_at=1.5),
        StatsSnapshot(
            num_running=1,
            num_waiting=2,
            kv_usage=0.25,
            prefix_cache_queries=10,
            prefix_cache_hits=4,
            num_preemptions=0,
            num_prompt_tokens=30,
            num_generation_tokens=12,
            device_busy_seconds=0.5,
            num_blocks=64,
            max_model_len=512,
        ),
        ComponentDown("executor-0", 1),
    ],
}


@pytest.mark.parametrize(
    ("union", "message"), [(u, m) for u, messages in MESSAGES.items() for m in messages]
)
def test_every_message_round_trips_through_its_sockets_decoder(
    union: object, message: object
) -> None:
    decoded = Decoder(union, "test").decode(encode(message))  # type: ignore[arg-type]
    assert decoded == message
    assert type(decoded) is type(message)


MALFORMED = {
    "not msgpack": b"\xc1\xff\x00garbage",
    "empty frame": b"",
    "an untagged map": msgspec.msgpack.encode({"request_id": "r"}),
    "an unknown tag": msgspec.msgpack.encode({"type": "Shutdown"}),
    "a missing field": msgspec.msgpack.encode({"type": "EngineRequest", "request_id": "r"}),
    "a wrong field type": msgspec.msgpack.encode(
        {"type": "AbortRequests", "request_ids": "not a list"}
    ),
    "truncated": encode(MESSAGES[ToScheduler][0])[:-3],
}


@pytest.mark.parametrize("frame", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_frame_is_dropped_and_logged(
    frame: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert Decoder(ToScheduler, "scheduler").decode(frame) is None
    assert "dropped a malformed message on scheduler" in caplog.text


def test_a_message_for_another_socket_is_dropped() -> None:
    """A socket's decoder accepts its own union only: a plan sent to the frontend is refused."""
    plan = MESSAGES[ToExecutor][0]
    assert Decoder(ToFrontend, "frontend").decode(encode(plan)) is None


def test_request_errors_say_what_kind_of_failure_they_are() -> None:
    assert RequestError.of(ParameterError("top_p", "must be in (0, 1]")) == RequestError(
        kind=ErrorKind.INVALID_REQUEST, message="top_p: must be in (0, 1]", param="top_p"
    )
    assert RequestError.of(QueueFullError("full")).kind is ErrorKind.QUEUE_FULL
    internal = RequestError.of(KeyError("r"))
    assert (internal.kind, internal.param) == (ErrorKind.INTERNAL, None)
    assert "KeyError" in internal.message


def test_fan_out_gives_n_single_requests_with_distinct_seeds() -> None:
    children = SamplingParams(n=3, seed=10, temperature=1.0).fan_out()
    assert [(c.n, c.seed, c.temperature) for c in children] == [
        (1, 10, 1.0),
        (1, 11, 1.0),
        (1, 12, 1.0),
    ]
    assert [c.seed for c in SamplingParams(n=2).fan_out()] == [None, None]
