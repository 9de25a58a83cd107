"""The frames of tests/e2e/test_socket_fuzz.py: the hypothesis strategies that make them
(random bytes, random msgpack, well-typed but hostile messages of every type, and those damaged),
the frames the fuzzing found that a decoder chokes on, and what a socket's decoder makes of them."""

from __future__ import annotations

import math
import os
import typing
from collections.abc import Iterator
from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st

from shared import protocol
from shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequests,
    EngineRequest,
    ExecutorReady,
    ExecutorVersion,
    FrontendToTokenizer,
    Heartbeat,
    LaunchStep,
    NewRequestData,
    SamplingParams,
    SchedulerHello,
    SchedulerOutput,
    SchedulerToTokenizer,
    StatsSnapshot,
    TextDelta,
    TextDeltas,
    ToExecutor,
    ToFrontend,
    TokenizeResult,
    ToScheduler,
)

VOCAB_SIZE = 49152  # the embedded model's
ENGINE = ("scheduler", "executor-0")  # the components a frontend expects besides the workers
LIVE_IDS = [f"live-{k}" for k in range(4)]  # requests the standalone worker holds while fuzzed
ENCODE = msgspec.msgpack.Encoder().encode

# Examples per socket (each test may lower it): 2-10 s of the run each on 2 CPU cores.
FUZZ = settings(
    max_examples=60,
    deadline=None,
    # A process that died fails every example after it: shrinking would only mislead.
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=list(HealthCheck),
)

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1  # what msgpack (and msgspec) can carry
INTS = st.one_of(
    st.integers(0, 64),
    st.sampled_from([-1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, INT64_MIN, UINT64_MAX]),
    st.integers(INT64_MIN, UINT64_MAX),
)
FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 1e-300, 1e300, -1e300, math.nan, math.inf, -math.inf]),
    st.floats(0, 2),
    st.floats(),
)
TEXT = st.one_of(
    st.text(max_size=16),
    st.sampled_from(["", "\x00", "scheduler", "executor-0", "tokenizer-0", "live-0", "é" * 40]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    FLOATS,
    TEXT,
    st.binary(max_size=16),
    st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=12)),
)
MSGPACK = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT | INTS, inner, max_size=4),
    max_leaves=12,
)
TOKEN_IDS = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=12)

TAGGED = [  # every message a socket can receive, each with its own tag
    cls
    for cls in vars(protocol).values()
    if isinstance(cls, type)
    and issubclass(cls, msgspec.Struct)
    and cls.__struct_config__.tag is not None
    and cls is not ExecutorVersion  # ExecutorReady's tag: only its first field
]
TAGS = [cls.__struct_config__.tag for cls in TAGGED]
FIELD_NAMES = sorted({f.name for cls in TAGGED for f in msgspec.structs.fields(cls)})
Overrides = dict[str, st.SearchStrategy[Any]]
MARK = "\x01\x02\x03"  # a string that `damaged` finds in an encoding to replace


# What a field typed Any (chat_template_kwargs' values) may hold: anything msgpack carries.
ANY_VALUES: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | INTS | FLOATS | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)


def typed(t: mi.Type, overrides: Overrides) -> st.SearchStrategy[Any]:
    """Values of type `t` a typed decoder accepts: well-typed, and as hostile as that allows."""
    if isinstance(t, mi.StructType):
        return struct_of(t.cls, overrides)
    if isinstance(t, mi.ListType):
        items = st.lists(typed(t.item_type, overrides), max_size=6)
        return st.one_of(TOKEN_IDS, items) if isinstance(t.item_type, mi.IntType) else items
    if isinstance(t, mi.TupleType):  # a fixed-length tuple (the host tier's copies)
        return st.tuples(*(typed(item, overrides) for item in t.item_types))
    if isinstance(t, mi.DictType):
        keys, values = typed(t.key_type, overrides), typed(t.value_type, overrides)
        return st.dictionaries(keys, values, max_size=4)
    if isinstance(t, mi.UnionType):
        return st.one_of(*(typed(member, overrides) for member in t.types))
    if isinstance(t, mi.EnumType):
        return st.sampled_from(list(t.cls))
    scalars: dict[type[mi.Type], st.SearchStrategy[Any]] = {
        mi.IntType: INTS,
        mi.FloatType: FLOATS,
        mi.StrType: TEXT,
        mi.BoolType: st.booleans(),
        mi.NoneType: st.none(),
        mi.BytesType: st.binary(max_size=40),
        mi.AnyType: ANY_VALUES,
    }
    return scalars[type(t)]


def struct_of(cls: type[msgspec.Struct], overrides: Overrides | None = None) -> st.SearchStrategy:
    """Instances of `cls`; `overrides` draws the fields of that name (in nested structs too)."""
    overrides = overrides or {}
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    fields = {f.name: overrides.get(f.name, typed(f.type, overrides)) for f in info.fields}
    required = {f.name for f in info.fields if f.required}
    return st.fixed_dictionaries(
        {name: fields[name] for name in required},
        optional={name: s for name, s in fields.items() if name not in required},
    ).map(lambda kwargs: cls(**kwargs))


def messages_of(union: Any, overrides: Overrides | None = None) -> st.SearchStrategy:
    return st.one_of(*(struct_of(cls, overrides) for cls in typing.get_args(union) or (union,)))


def _slots(tree: Any) -> Iterator[tuple[Any, Any]]:
    """(container, key) of every value in a msgpack tree, nested ones too."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in list(items):
        yield tree, key
        if isinstance(value, dict | list):
            yield from _slots(value)


@st.composite
def damaged(draw: st.DrawFn, messages: st.SearchStrategy) -> bytes:
    """A message made unreadable, or nearly: a value anywhere in it replaced (mostly by one
    of the wrong type), dropped or added, a huge value put in, its tag changed, the struct sent
    as an array, a string (the tag too) made of bytes that are not UTF-8, maps nested thousands
    deep put in; or its encoding cut short, extended, or one byte of it changed."""
    tree = msgspec.to_builtins(draw(messages))
    how = draw(
        st.sampled_from(
            ["replace", "drop", "add", "huge", "tag", "array", "bytes", "non-utf8", "nest"]
        )
    )
    slots = list(_slots(tree))
    if how in ("non-utf8", "nest"):
        strings = [(c, k) for c, k in slots if isinstance(c[k], str)]
        container, key = draw(st.sampled_from(strings)) if strings else (tree, "x")
        container[key] = MARK  # replaced in the encoding below
    elif how in ("replace", "drop", "huge") and slots:
        container, key = draw(st.sampled_from(slots))
        if how == "drop":
            del container[key]
        else:
            huge = st.sampled_from([[7] * 300_000, ["x"] * 100_000, "x" * 2_000_000, {}])
            container[key] = draw(huge if how == "huge" else MSGPACK)
    elif how == "add":
        tree[draw(st.sampled_from(FIELD_NAMES) | TEXT)] = draw(MSGPACK)
    elif how == "tag":
        tree["type"] = draw(st.sampled_from(TAGS) | TEXT | MSGPACK)
    elif how == "array":
        tree = list(tree.values())
    data = ENCODE(tree)
    if how == "non-utf8":  # as long as the mark: the string's length still holds
        return data.replace(MARK.encode(), b"\xff\x80\xfe", 1)
    if how == "nest":
        return data.replace(ENCODE(MARK), nested(draw(st.integers(100, 5000))), 1)
    if how != "bytes":
        return data
    at = draw(st.integers(0, len(data) - 1))
    edit = draw(st.sampled_from(["cut", "extend", "change"]))
    if edit == "cut":
        return data[:at]
    if edit == "extend":
        return data + draw(st.binary(min_size=1, max_size=8))
    return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]


def frames_for(
    union: Any, overrides: Overrides | None = None, intact: tuple[type, ...] | None = None
) -> st.SearchStrategy[bytes]:
    """One frame for a socket that decodes `union`; of its messages, only those of `intact`
    (default: all) are also sent well-typed, the others only damaged."""
    messages = messages_of(union, overrides)
    whole = messages if intact is None else st.one_of(*(struct_of(c, overrides) for c in intact))
    return st.one_of(
        st.binary(max_size=512),
        MSGPACK.map(ENCODE),
        st.tuples(
            st.sampled_from(TAGS), st.dictionaries(st.sampled_from(FIELD_NAMES) | TEXT, MSGPACK)
        ).map(lambda tag_fields: ENCODE({**tag_fields[1], "type": tag_fields[0]})),
        whole.map(ENCODE),
        st.sampled_from(TAGGED).flatmap(struct_of).map(ENCODE),  # mostly another socket's
        damaged(messages),
    )


def nested(depth: int) -> bytes:
    """`depth` maps, each inside the last: a few bytes each, and no field type bounds them."""
    return b"\x81\xa1a" * depth + b"\xc0"


def deeply_nested(tag: str, depth: int = 5000) -> bytes:
    """A message tagged `tag` with an unknown field that nests `depth` maps."""
    return ENCODE({"type": tag, "x": None})[:-1] + nested(depth)


VALID_HOSTILE_REQUESTS = st.builds(
    EngineRequest,
    request_id=st.uuids().map(lambda u: f"fuzz-{u}"),
    prompt_token_ids=TOKEN_IDS,
    sampling_params=st.builds(
        SamplingParams,
        temperature=st.sampled_from([0.0, 1e-30, 1.0, 1e30, math.inf]),
        top_p=st.sampled_from([1e-30, 0.5, 1.0]),
        top_k=st.none() | st.sampled_from([1, 2, VOCAB_SIZE, 10**9, UINT64_MAX]),
        min_p=st.sampled_from([0.0, 0.5, 1.0]),
        seed=st.none() | st.sampled_from([0, -1, INT64_MIN, UINT64_MAX]),
        presence_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
        frequency_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
        repetition_penalty=st.sampled_from([1e-30, 1.0, 1e30, math.inf]),
        logit_bias=st.none() | st.dictionaries(st.integers(0, VOCAB_SIZE - 1), FLOATS, max_size=3),
        logprobs=st.none() | st.sampled_from([0, 20, VOCAB_SIZE]),
        max_tokens=st.none() | st.integers(1, 4),
        min_tokens=st.integers(0, 2),
        stop_token_ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3),
        ignore_eos=st.booleans(),
        stop=st.lists(TEXT, max_size=3),
        n=st.integers(1, 3),
    ),
    arrival_time=FLOATS,
)


def decoded(union: Any, frame: bytes) -> object:
    """What a socket's decoder makes of `frame`: a message, None (dropped), or what escapes it."""
    try:
        return msgspec.msgpack.decode(frame, type=union)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    except Exception as exc:
        return exc


def tally(union: Any, frames: list[bytes]) -> None:
    """Count what was sent, by what the socket's decoder makes of it (hypothesis statistics)."""
    for frame in frames:
        message = decoded(union, frame)
        event("malformed" if message is None else type(message).__name__)


FRONTEND_FRAMES = frames_for(
    ToFrontend,
    {
        "component": st.sampled_from([*ENGINE, "tokenizer-0"]) | TEXT.map("tokenizer-".__add__),
        "protocol_version": st.just(PROTOCOL_VERSION),
    },
    intact=(TextDelta, TextDeltas, TokenizeResult, Heartbeat, StatsSnapshot),
)
SCHEDULER_FRAMES = st.one_of(
    frames_for(ToScheduler, intact=(EngineRequest, AbortRequests)),
    VALID_HOSTILE_REQUESTS.map(ENCODE),
)
# A DEALER reads a multi-part message one part at a time: each part is a frame of its own.
WORKER_FRONTEND_FRAMES = st.lists(frames_for(FrontendToTokenizer), min_size=1, max_size=3)
WORKER_SCHEDULER_FRAMES = st.lists(
    frames_for(SchedulerToTokenizer, {"request_id": st.sampled_from(LIVE_IDS) | TEXT}),
    min_size=1,
    max_size=3,
)
EXECUTOR_FRAMES = st.lists(
    frames_for(ToExecutor, intact=(SchedulerHello,)),
    min_size=1,
    max_size=3,
)
HUGE_RANDOM = os.urandom(8 << 20)
# AbortRequests, with its tag or its one id made of a byte that is not UTF-8.
INVALID_UTF8_TAG = ENCODE(AbortRequests(["x"])).replace(
    b"\xadAbortRequests", b"\xad\x80bortRequests"
)
INVALID_UTF8_ID = ENCODE(AbortRequests(["x"])).replace(b"\xa1x", b"\xa1\x80")


def inconsistent_plans(report: ExecutorReady) -> dict[str, list[msgspec.Struct]]:
    """Well-typed messages that no scheduler of this executor's session would send."""

    def plan(tokens: list[int], blocks: list[int], **sampling: Any) -> SchedulerOutput:
        data = NewRequestData(
            request_id="r",
            prompt_token_ids=tokens,
            output_token_ids=[],
            sampling_params=SamplingParams(temperature=0.0, **sampling),
            block_ids=blocks,
            num_computed_tokens=0,
        )
        return SchedulerOutput(
            step=1,
            new_requests=[data],
            cached_requests=[],
            num_scheduled_tokens={"r": len(tokens)},
            finished_request_ids=[],
        )

    unknown = plan([1, 2], [0])
    unknown.num_scheduled_tokens = {"never-sent": 1}
    too_many = plan([1, 2], [0])
    too_many.num_scheduled_tokens = {"r": 50}
    return {
        "a block id past the cache": [plan([1, 2], [report.num_blocks]), LaunchStep(1)],
        "a token id past the vocabulary": [plan([report.vocab_size], [0]), LaunchStep(1)],
        "top_k 0": [plan([1, 2], [0], top_k=0), LaunchStep(1)],
        "a launch of a plan never sent": [LaunchStep(9)],
        "a request never sent": [unknown, LaunchStep(1)],
        "more tokens than the request has": [too_many, LaunchStep(1)],
    }
