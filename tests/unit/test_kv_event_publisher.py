"""The scheduler's KV event batches carry its load as routers read it: running and waiting
requests, and each tokenizer worker's share of them."""

from __future__ import annotations

from pathlib import Path

import msgspec
import zmq

from services.scheduler.kv_events import KvEventPublisher
from shared.protocol import KvEventBatch
from shared.wire_security import WireSecurity
from tests.unit.scheduler_setup import add, make_scheduler


def test_a_batch_counts_the_waiting_requests_and_carries_each_workers_share(tmp_path: Path) -> None:
    context = zmq.Context()
    address = f"ipc://{tmp_path}/kv-events"
    publisher = KvEventPublisher(context, address, replica=1, security=WireSecurity())
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(address)
    scheduler = make_scheduler(kv_events=True)
    decoder = msgspec.msgpack.Decoder(KvEventBatch)
    try:
        # A subscription takes a moment to arrive: publish again (as a new session) until one
        # batch comes through, then read the next.
        for _ in range(100):
            publisher.new_engine()
            publisher.publish(scheduler, {})
            if subscriber.poll(100):
                subscriber.recv()
                break
        add(scheduler, "a", list(range(10, 30)))
        add(scheduler, "b", list(range(40, 47)))
        publisher.publish(scheduler, {b"tokenizer-0": 2})
        assert subscriber.poll(5000)
        batch = decoder.decode(subscriber.recv())
        assert (batch.replica, batch.num_running, batch.num_waiting) == (1, 0, 2)
        assert batch.num_by_worker == {"tokenizer-0": 2}
    finally:
        subscriber.close(linger=0)
        publisher.socket.close(linger=0)
        context.term()
