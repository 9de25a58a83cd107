"""Endings a tokenizer worker owes a frontend whose link was full.

A frontend that stops reading fills its link (ZeroMQ's high-water mark); the worker then stops
the requests whose deltas did not fit, so that one slow frontend never stalls the others. Each
of those requests still needs its one ending, or its client would wait for ever: the worker
keeps an error delta for it here and sends them all as one message once the link takes it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import zmq

from shared.ipc import encode
from shared.protocol import RequestError, TextDelta, TextDeltas


class OwedEndings:
    def __init__(self, worker_name: str) -> None:
        self.error = RequestError.unavailable(
            f"the frontend fell behind: its link from {worker_name} was full"
        )
        self.owed: dict[zmq.Socket[Any], list[TextDelta]] = defaultdict(list)

    def owe(self, link: zmq.Socket[Any], request_ids: list[str]) -> None:
        self.owed[link].extend(TextDelta.failure(rid, self.error) for rid in request_ids)

    def flush(self) -> None:
        """Send what each link now takes; a link still full keeps its debts."""
        for link in [link for link, endings in self.owed.items() if endings]:
            try:
                link.send(encode(TextDeltas(self.owed[link])), flags=zmq.DONTWAIT)
            except zmq.Again:
                continue
            del self.owed[link]

    def forget(self, link: zmq.Socket[Any]) -> None:
        """A frontend that went: its clients went with it."""
        self.owed.pop(link, None)

    def __len__(self) -> int:
        return sum(len(endings) for endings in self.owed.values())
