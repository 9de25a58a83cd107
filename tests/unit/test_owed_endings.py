"""A frontend whose link filled up still gets one ending for each request the worker stopped:
an error delta, sent once the link takes it again (real ZeroMQ sockets, over inproc: no I/O
thread moves messages on behind the test's back, so a full link stays full until it reads)."""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

from services.tokenizer.owed_endings import OwedEndings
from shared.protocol import ErrorKind, FinishReason, TextDeltas


def test_stopped_requests_get_their_error_ending_once_the_link_drains() -> None:
    context: zmq.Context[Any] = zmq.Context.instance()
    frontend, link = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    for socket in (frontend, link):
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 1)
        socket.setsockopt(zmq.RCVHWM, 1)
    frontend.bind("inproc://owed-endings-link")
    link.connect("inproc://owed-endings-link")
    try:
        filler = b"a reply the frontend has not read"
        sent = 0
        while True:  # fill the link: the frontend reads nothing
            try:
                link.send(filler, flags=zmq.DONTWAIT)
            except zmq.Again:
                break
            sent += 1
        owed = OwedEndings("tokenizer-0")
        owed.owe(link, ["a", "b"])
        owed.flush()
        assert len(owed) == 2  # still full: nothing lost, nothing sent
        for _ in range(sent):
            frontend.recv()
        assert link.poll(5000, zmq.POLLOUT)  # the link takes messages again
        owed.flush()
        assert len(owed) == 0
        assert frontend.poll(5000)
        decoded = msgspec.msgpack.decode(frontend.recv(), type=TextDeltas)
        assert [d.request_id for d in decoded.deltas] == ["a", "b"]
        for delta in decoded.deltas:
            assert delta.finish_reason == FinishReason.ERROR
            assert delta.error is not None and delta.error.kind == ErrorKind.UNAVAILABLE
            assert "fell behind" in delta.error.message
        owed.owe(link, ["c"])
        owed.forget(link)  # the frontend went
        assert len(owed) == 0
    finally:
        frontend.close()
        link.close()
