"""A tokenizer worker places no request on an engine replica the frontend says is down
(services/tokenizer/process.py): the requests it had placed there end with an error, new ones
go to the replicas left, and with none left they end at once, naming each replica's fault."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from services.tokenizer.process import TokenizerProcess
from shared.config import Config
from shared.protocol import (
    EngineRequest,
    GenerateRequest,
    SamplingParams,
    TextDelta,
    TextDeltas,
)


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[TokenizerProcess, list[zmq.Socket[Any]]]]:
    """A worker over three replicas' scheduler sockets, bound here."""
    context: zmq.Context[Any] = zmq.Context.instance()
    addresses = [f"ipc://{tmp_path}/scheduler-{r}" for r in range(3)]
    schedulers = []
    for address in addresses:
        socket = context.socket(zmq.ROUTER)
        socket.bind(address)
        schedulers.append(socket)
    config = Config(
        data_parallel_size=3, scheduler_address=",".join(addresses),
        frontend_address=f"ipc://{tmp_path}/frontend", data_parallel_routing="round-robin",
    )  # fmt: skip
    process = TokenizerProcess(config)
    yield process, schedulers
    for socket in schedulers:
        socket.close(linger=0)


def received(schedulers: list[zmq.Socket[Any]]) -> dict[str, int]:
    """Which replica each request sent so far reached."""
    placed = {}
    for replica, socket in enumerate(schedulers):
        while socket.poll(200):
            _, frame = socket.recv_multipart()
            placed[msgspec.msgpack.decode(frame, type=EngineRequest).request_id] = replica
    return placed


def test_requests_avoid_replicas_that_are_down(
    worker: tuple[TokenizerProcess, list[zmq.Socket[Any]]],
) -> None:
    process, schedulers = worker
    context: zmq.Context[Any] = zmq.Context.instance()
    frontend, link = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    frontend.bind("inproc://frontend-link")
    link.connect("inproc://frontend-link")

    def ask(request_id: str) -> None:
        message = GenerateRequest(
            request_id=request_id, sampling_params=SamplingParams(max_tokens=4),
            prompt_token_ids=[5, 6, 7],
        )  # fmt: skip
        process._from_frontend(link, message)

    def endings() -> dict[str, str]:
        ended = {}
        while frontend.poll(200):
            message = msgspec.msgpack.decode(frontend.recv(), type=TextDelta | TextDeltas)
            for delta in message.deltas if isinstance(message, TextDeltas) else [message]:
                assert delta.error is not None
                ended[delta.request_id] = delta.error.message
        return ended

    for index in range(6):
        ask(f"before-{index}")
    before = received(schedulers)
    assert sorted(before.values()) == [0, 0, 1, 1, 2, 2]  # in turn, over all three
    process._replicas_down({1: "its executor exited"})
    lost = {rid for rid, replica in before.items() if replica == 1}
    assert endings() == {rid: "engine replica 1 is down: its executor exited" for rid in lost}
    for index in range(6):
        ask(f"after-{index}")
    assert set(received(schedulers).values()) == {0, 2}
    process._replicas_down({0: "stalled", 1: "gone", 2: "gone"})
    assert len(endings()) == 10  # all left: two of the first six and the six after on 0 and 2
    ask("late")
    assert endings() == {
        "late": "no engine replica can take it (replica 0: stalled; replica 1: gone; replica 2:"
        " gone)"
    }
    frontend.close(linger=0)
    link.close(linger=0)
