"""ZeroMQ plumbing shared by every process: one socket shape, one codec.

Only the frontend and the scheduler bind (ROUTER); tokenizer workers and executors connect
(DEALER) under a stable identity, so a pool grows without new addresses and a reply goes
back to whoever asked. Messages are msgpack-encoded msgspec Structs; decoding is validation,
and a malformed message is logged and dropped, never raised.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import msgspec
import zmq

logger = logging.getLogger(__name__)
_ENCODER = msgspec.msgpack.Encoder()
SocketT = TypeVar("SocketT", bound=zmq.Socket[Any])  # a sync or an asyncio socket


def encode(message: msgspec.Struct) -> bytes:
    return _ENCODER.encode(message)


class Decoder:
    """Decodes one socket's union of message types; returns None for anything malformed."""

    def __init__(self, types: Any, socket_name: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(types)
        self._socket_name = socket_name

    def decode(self, data: bytes) -> Any | None:
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("dropped a malformed message on %s: %s", self._socket_name, exc)
            return None


def bind_router(context: zmq.Context[SocketT], address: str) -> SocketT:
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone peer raises, not vanishes
    socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer takes its identity back
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(address)
    return socket


def connect_dealer(context: zmq.Context[SocketT], address: str, identity: str) -> SocketT:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, identity.encode())
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket
