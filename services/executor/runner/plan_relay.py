"""Rank 0's publisher of plans to the other tensor-parallel ranks."""

from __future__ import annotations

import time
from typing import Any

import zmq

from shared.ipc import encode
from shared.protocol import ToRanks

WATCH_INTERVAL_S = 0.2  # how often rank 0 looks at the other ranks, and they at rank 0


class PlanRelay:
    """Rank 0's side of the relay: an XPUB socket the other ranks subscribe to.

    Nothing is dropped: no high-water mark on either side, and rank 0 publishes only once
    every rank's subscription has arrived (XPUB shows each one).
    """

    def __init__(self, address: str) -> None:
        context: zmq.Context[Any] = zmq.Context.instance()
        self.socket = context.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, repeats included
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)

    def wait_for(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        seen = 0
        while seen < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count - seen} executor ranks did not connect in {timeout} s")
            if self.socket.poll(int(WATCH_INTERVAL_S * 1000)):
                seen += self.socket.recv()[:1] == b"\x01"  # a subscription, not its end

    def send(self, message: ToRanks) -> None:
        self.socket.send(encode(message))
