"""ZeroMQ plumbing shared by every process: one socket shape, one codec.

Only the frontend and the scheduler bind (ROUTER); tokenizer workers and executors connect
(DEALER) under a stable identity, so a pool grows without new addresses and a reply goes
back to whoever asked. Messages are msgpack-encoded msgspec Structs; decoding is validation,
and a malformed message is logged and dropped, never raised. Every bind and connect goes
through here, so `shared.wire_security` decides, for each, what it may expose and which keys
it uses.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import msgspec
import zmq

from shared.constants import MAX_MESSAGE_BYTES, ZMTP_HEARTBEAT_MS
from shared.wire_security import LOCAL, WireSecurity, stop_authenticator

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
        # Not only DecodeError and ValidationError: msgspec raises UnicodeDecodeError for a
        # string that is not UTF-8 and RecursionError for maps nested a thousand deep, and a
        # peer can send any bytes. The message is cut: it may quote megabytes of the frame.
        except Exception as exc:
            logger.warning("dropped a malformed message on %s: %.200s", self._socket_name, str(exc))
            return None


def routed(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """(sender, frame) of what a ROUTER received; None, logged, for a message of several parts,
    which no component sends."""
    if len(frames) != 2:
        logger.warning("dropped a message of %d parts from %r", len(frames) - 1, frames[0][:64])
        return None
    return frames[0], frames[1]


def bind_router(
    context: zmq.Context[SocketT], address: str, security: WireSecurity = LOCAL
) -> SocketT:
    security.check_bind(address)
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone peer raises, not vanishes
    socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer takes its identity back
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # larger: the peer is disconnected
    security.secure_server(socket)
    socket.bind(address)
    return socket


def connect_dealer(
    context: zmq.Context[SocketT], address: str, identity: str, security: WireSecurity = LOCAL
) -> SocketT:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, identity.encode())
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    # ZMTP heartbeats: a connection that stopped carrying anything is found and reconnected.
    # NOTE: ROUTER_HANDOVER hands an identity to whoever connects with it last, and leaves the
    # connection it took it from unable to send or receive (libzmq 4.3); with heartbeats the
    # real component reconnects within seconds and takes its identity back.
    socket.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ZMTP_HEARTBEAT_MS)
    security.secure_client(socket)
    socket.connect(address)
    return socket


def subscribe(
    context: zmq.Context[SocketT], address: str, security: WireSecurity = LOCAL
) -> SocketT:
    """A SUB socket taking everything published at `address` (KV events)."""
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    security.secure_client(socket)
    socket.connect(address)
    return socket


def terminate(context: zmq.Context[Any]) -> None:
    """End a context whose sockets are closed, with its CURVE authenticator if it has one."""
    stop_authenticator(context)
    context.term()
