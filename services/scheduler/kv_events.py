"""The scheduler's prefix-cache events, published for routers on --kv-events-address.

After each turn of the scheduler loop that changed something (keys cached or evicted, the
number of running or waiting requests, or each tokenizer worker's count of them), one
KvEventBatch goes out on a PUB socket; at least one a second otherwise, so a router that joins
late learns the load. A new engine (a new
executor adopted) starts a new session: a router drops what it heard of the old one.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from typing import Any

import zmq

from services.scheduler.scheduler import Scheduler
from shared.ipc import encode
from shared.protocol import KvEventBatch
from shared.wire_security import WireSecurity

KEEPALIVE_S = 1.0


class KvEventPublisher:
    def __init__(
        self, context: zmq.Context[Any], address: str, replica: int, security: WireSecurity
    ) -> None:
        security.check_bind(address)
        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        security.secure_server(self.socket)
        self.socket.bind(address)
        self.replica = replica
        self.session, self.seq = 0, 0
        self._load: tuple[object, ...] | None = None  # (running, waiting, full, by worker) sent
        self._sent_at = 0.0

    def new_engine(self) -> None:
        self.session, self.seq = random.getrandbits(62), 0
        self._load = None

    def publish(self, scheduler: Scheduler, by_worker: Mapping[bytes, int]) -> None:
        """A batch, if anything changed since the last one or it is a second old.
        `by_worker`: unfinished requests by the identity of the tokenizer worker they came
        from."""
        if scheduler.block_events is None:
            return
        stored, removed = scheduler.block_events.take()
        counts = {worker.decode(errors="replace"): n for worker, n in by_worker.items() if n}
        running, waiting, full = (
            len(scheduler.running),
            len(scheduler.waiting),
            _queue_full(scheduler),
        )
        load = (running, waiting, full, tuple(sorted(counts.items())))
        now = time.monotonic()
        if not stored and not removed and load == self._load and now - self._sent_at < KEEPALIVE_S:
            return
        batch = KvEventBatch(
            replica=self.replica,
            session=self.session,
            seq=self.seq,
            block_size=scheduler.config.block_size,
            stored=stored,
            removed=removed,
            num_running=running,
            num_waiting=waiting,
            kv_usage=scheduler.kv.usage,
            queue_full=full,
            num_by_worker=counts,
        )
        # NOTE: a PUB socket drops what a slow subscriber cannot take; the seq tells it so.
        self.socket.send(encode(batch), flags=zmq.DONTWAIT)
        self.seq += 1
        self._load, self._sent_at = load, now


def _queue_full(scheduler: Scheduler) -> bool:
    """Whether the waiting queue takes no new request now (what StatsSnapshot.queue_full says,
    without building a snapshot every turn)."""
    config, waiting = scheduler.config, scheduler.waiting
    by_requests = (
        config.max_queued_requests is not None and len(waiting) >= config.max_queued_requests
    )
    by_tokens = (
        config.max_queued_tokens is not None and waiting.num_tokens >= config.max_queued_tokens
    )
    return by_requests or by_tokens
