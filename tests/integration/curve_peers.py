"""Peers for the CURVE tests: how a socket's handshakes ended, read from its monitor (an event
each, so no test has to guess how long a refused peer takes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

HANDSHAKES = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)
GUARD_MS = 20_000  # only against a hang: every wait ends on an event long before


def handshakes(socket: zmq.Socket[Any]) -> tuple[zmq.Socket[Any], Iterator[bool]]:
    """A monitor of `socket` (made before its peers connect), and the handshakes it reports,
    in order: whether each succeeded."""
    monitor = socket.get_monitor_socket(HANDSHAKES)
    monitor.setsockopt(zmq.RCVTIMEO, GUARD_MS)

    def outcomes() -> Iterator[bool]:
        while True:
            yield recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED

    return monitor, outcomes()
