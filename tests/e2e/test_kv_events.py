"""--kv-events-address: the scheduler publishes the keys of the blocks its prefix cache holds
(shared/block_hashes.py) and its load (each tokenizer worker's share of it too), so a router
that computes a prompt's keys finds the engine holding it."""

from __future__ import annotations

import time

import msgspec
import zmq

from shared.block_hashes import prefix_block_keys
from shared.protocol import KvEventBatch
from tests.e2e.server import free_port, start_server

PROMPT = [(7 * n + 3) % 4000 + 100 for n in range(40)]  # token ids: two full blocks of 16


def test_a_served_prompts_blocks_are_published_with_the_load() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    server = start_server("--kv-events-address", address)
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(address)
    decoder = msgspec.msgpack.Decoder(KvEventBatch)
    try:
        batches: list[KvEventBatch] = []
        deadline = time.monotonic() + 30
        while not batches and time.monotonic() < deadline:  # the keepalive: subscribed
            if socket.poll(500):
                batches.append(decoder.decode(socket.recv()))
        server.client().completions.create(
            model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4, temperature=0
        )
        stored: set[bytes] = set()
        keys = prefix_block_keys(PROMPT, 16)
        while not set(keys) <= stored and time.monotonic() < deadline:
            if socket.poll(500):
                batch = decoder.decode(socket.recv())
                batches.append(batch)
                stored.update(batch.stored)
        assert set(keys) <= stored
        assert {b.replica for b in batches} == {0} and len({b.session for b in batches}) == 1
        seqs = [b.seq for b in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # none lost
        assert batches[0].block_size == 16
        running = [b for b in batches if b.num_running == 1]  # counted by its worker too
        assert running and all(
            len(b.num_by_worker) == 1 and next(iter(b.num_by_worker)).startswith("tokenizer-")
            for b in running
        )
        assert sum(running[0].num_by_worker.values()) == 1
    finally:
        socket.close()
        context.term()
        server.stop()
