"""Prefill/decode disaggregation in the executor (--prefill-replicas; the scheduler's half is
services/scheduler/handover.py).

A prefill replica's executor copies each handed-over prompt's blocks (KVExport) to pinned
host slots, queued on the compute stream as it takes the plan, like the host tier's copies,
and serves them from a thread to the decode executor that asks (shared/protocol/transfer.py);
an export leaves once fetched to its last block, or, the slots being full, oldest first.

A decode replica's executor fetches each KVImport of a plan as it takes it, in pieces of at
most FETCH_BYTES, and copies the bytes into the plan's blocks before its forward pass. A fetch
that fails (the prefill executor gone or slow, the export dropped) is reported with the step's
tokens (ModelRunnerOutput.kv_import_failed); with tensor parallelism every rank fetches its
own heads from the same rank of the prefill engine, and the ranks agree on each fetch's fate.

NOTE: the fetch runs on the executor's thread as it takes the plan: the plan before it is
then on the device, but a slow fetch delays the steps after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import torch
import zmq

from services.executor.parallel.tensor_parallel import TensorParallel
from services.executor.runner.host_kv import HostKVPool, copy_host_kv
from shared.config import Config
from shared.ipc import Decoder, bind_router, connect_dealer, encode
from shared.protocol import (
    KVExport,
    KVFetch,
    KVFetchReply,
    KVImport,
    ModelRunnerOutput,
    SchedulerOutput,
)
from shared.wire_security import WireSecurity

logger = logging.getLogger(__name__)
EXPORT_BUFFER_BYTES = 4 << 30  # host memory a prefill rank holds exports in, at most
FETCH_BYTES = 32 << 20  # a fetch's piece: well under the sockets' message bound
FETCH_TIMEOUT_S = 5.0  # a decode rank's wait for one piece
EXPORT_WAIT_S = 3.0  # a prefill rank's wait for an export it has not taken yet
MAX_GONE = 4096  # exports remembered as fetched or dropped, to answer later asks at once


def move_kv(host: HostKVPool | None, handover: Handover | None, plan: SchedulerOutput) -> None:
    """The plan's copies to and from the host tier and its handovers, queued before its
    forward pass."""
    copy_host_kv(host, plan)
    if handover is not None:
        handover.run(plan)


def rank_address(address: str, rank: int) -> str:
    """Tensor-parallel rank `rank`'s address of a replica's --kv-transfer-address entry."""
    if rank == 0:
        return address
    if address.startswith("tcp://"):
        host, port = address.rsplit(":", 1)
        return f"{host}:{int(port) + rank}"
    return f"{address}-{rank}"


class KVExports:
    """A prefill rank's handed-over blocks, until fetched."""

    def __init__(self, pool: HostKVPool, address: str, security: WireSecurity) -> None:
        self.pool = pool
        self._free = list(range(pool.num_slots))
        # request id -> (its slots in block order, the copy's end on the device)
        self._held: OrderedDict[str, tuple[list[int], torch.cuda.Event | None]] = OrderedDict()
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._cond = threading.Condition()
        self._socket = bind_router(zmq.Context.instance(), address, security)
        threading.Thread(target=self._serve, name="kv-exports", daemon=True).start()

    def add(self, exports: list[KVExport]) -> None:
        """Queue the copies of a plan's exports (they run after the steps launched before)."""
        for export in exports:
            slots = self._take_slots(export)
            if slots is None:
                continue
            self.pool.to_host(list(zip(export.block_ids, slots, strict=True)))
            done = torch.cuda.Event() if self.pool.device.type == "cuda" else None
            if done is not None:
                done.record()
            with self._cond:
                self._held[export.request_id] = (slots, done)
                self._cond.notify_all()

    def _take_slots(self, export: KVExport) -> list[int] | None:
        count = len(export.block_ids)
        with self._cond:
            if count > self.pool.num_slots:
                logger.warning(
                    "request_id=%s: %d blocks to hand over, more than the %d this rank holds",
                    export.request_id, count, self.pool.num_slots,
                )  # fmt: skip
                self._note_gone(export.request_id)
                return None
            while len(self._free) < count:  # the oldest export goes
                request_id, (slots, _) = self._held.popitem(last=False)
                self._free.extend(slots)
                self._note_gone(request_id)
            return [self._free.pop() for _ in range(count)]

    def _note_gone(self, request_id: str) -> None:
        self._gone[request_id] = None
        while len(self._gone) > MAX_GONE:
            self._gone.popitem(last=False)

    def _serve(self) -> None:
        decoder = Decoder(KVFetch, "KV exports")
        while True:
            identity, frame = self._socket.recv_multipart()
            fetch = decoder.decode(frame)
            if not isinstance(fetch, KVFetch):
                continue
            reply, data = self._answer(fetch)
            try:
                self._socket.send_multipart([identity, encode(reply), data])
            except zmq.ZMQError:  # that decode executor is gone
                logger.warning("request_id=%s: its fetcher is gone", fetch.request_id)

    def _answer(self, fetch: KVFetch) -> tuple[KVFetchReply, bytes]:
        """The blocks asked for, once the export is in (waiting for it a while)."""
        rid = fetch.request_id
        with self._cond:
            self._cond.wait_for(lambda: rid in self._held or rid in self._gone, EXPORT_WAIT_S)
            entry = self._held.get(rid)
        if entry is None:
            return KVFetchReply(
                error=f"no export of {rid!r} here (fetched, dropped, or never made)"
            ), b""
        slots, done = entry
        if done is not None:
            done.synchronize()  # the copy out of the GPU is in
        end = fetch.first + fetch.count
        if not 0 <= fetch.first < end <= len(slots):
            return KVFetchReply(error=f"blocks {fetch.first}..{end - 1} of {len(slots)}"), b""
        with self._cond:
            if self._held.get(rid) is not entry:  # dropped meanwhile: its slots may be reused
                return KVFetchReply(error=f"the export of {rid!r} was dropped"), b""
            data = self.pool.slots[slots[fetch.first : end]].numpy().tobytes()
            if end == len(slots):  # fetched to its end: done
                del self._held[rid]
                self._free.extend(slots)
                self._note_gone(rid)
        reply = KVFetchReply(num_blocks=fetch.count, block_bytes=self.pool.block_bytes)
        return reply, data


class KVImports:
    """A decode rank's fetches from the prefill replicas' same ranks."""

    def __init__(
        self, pool: HostKVPool, addresses: list[str], security: WireSecurity, name: str
    ) -> None:
        self.pool = pool
        self.addresses = addresses
        self.security = security
        self.name = name
        self._sockets: dict[int, zmq.Socket[Any]] = {}
        self._decoder = Decoder(KVFetchReply, "KV fetch")

    def load(self, entry: KVImport) -> str | None:
        """Fetch the blocks and queue their copies into the cache; an error, or None."""
        if not 0 <= entry.source < len(self.addresses):
            return f"no prefill replica {entry.source}"
        per_piece = max(FETCH_BYTES // self.pool.block_bytes, 1)
        for start in range(0, len(entry.block_ids), per_piece):
            block_ids = entry.block_ids[start : start + per_piece]
            fetch = KVFetch(entry.request_id, entry.first + start, len(block_ids))
            data, error = self._fetch(entry.source, fetch)
            if error is not None:
                return error
            staged = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            staged = staged.view(len(block_ids), *self.pool.slots.shape[1:])
            self.pool.write(block_ids, staged.to(self.pool.device))
        return None

    def _fetch(self, source: int, fetch: KVFetch) -> tuple[bytes, str | None]:
        socket = self._socket(source)
        socket.send(encode(fetch))
        deadline = time.monotonic() + FETCH_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            if not socket.poll(int(left * 1000) + 1):
                break
            header, data = socket.recv_multipart()
            reply = self._decoder.decode(header)
            if not isinstance(reply, KVFetchReply):
                continue
            if reply.error:
                return b"", reply.error
            if reply.block_bytes != self.pool.block_bytes or len(data) != fetch.count * (
                self.pool.block_bytes
            ):
                return b"", f"blocks of {reply.block_bytes} bytes; this rank's are otherwise"
            return data, None
        # An answer may still come: a new socket never mistakes it for a later one's.
        self._sockets.pop(source).close(linger=0)
        return b"", f"prefill replica {source} did not answer in {FETCH_TIMEOUT_S:.0f} s"

    def _socket(self, source: int) -> zmq.Socket[Any]:
        if source not in self._sockets:
            address = self.addresses[source]
            self._sockets[source] = connect_dealer(
                zmq.Context.instance(), address, self.name, self.security
            )
        return self._sockets[source]


class Handover:
    """An executor rank's part in handovers: exports (a prefill replica) or imports."""

    def __init__(
        self, exports: KVExports | None, imports: KVImports | None, tp: TensorParallel
    ) -> None:
        self.exports = exports
        self.imports = imports
        self.tp = tp
        self.failed: dict[int, list[str]] = {}  # plan step -> its requests' failed imports
        self.seconds: dict[int, float] = {}  # plan step -> the time its imports took

    @classmethod
    def start(
        cls, config: Config, kv_caches: list[torch.Tensor], tp: TensorParallel
    ) -> Handover | None:
        """This rank's part, or None where the server is not disaggregated."""
        if not config.prefill_replicas:
            return None
        security = WireSecurity.of(config)
        addresses = [rank_address(a, tp.rank) for a in config.addresses("kv_transfer_address")]
        if config.replica < config.prefill_replicas:
            block_bytes = HostKVPool(kv_caches, 0).block_bytes
            num_slots = max(EXPORT_BUFFER_BYTES // block_bytes, 1)
            num_slots = min(num_slots, kv_caches[0].shape[1])
            pool = HostKVPool(kv_caches, num_slots)
            logger.info(
                "handing over KV from %s: up to %d blocks held (%.2f GiB)",
                addresses[config.replica], num_slots, num_slots * block_bytes / 2**30,
            )  # fmt: skip
            return cls(KVExports(pool, addresses[config.replica], security), None, tp)
        name = f"r{config.replica}-executor-{tp.rank}"
        return cls(None, KVImports(HostKVPool(kv_caches, 0), addresses, security, name), tp)

    def run(self, plan: SchedulerOutput) -> None:
        """The plan's exports and imports, as the executor takes it."""
        if self.exports is not None and plan.kv_exports:
            self.exports.add(plan.kv_exports)
        if self.imports is None or not plan.kv_imports:
            return
        started = time.perf_counter()
        for entry in plan.kv_imports:
            error = self.imports.load(entry)
            ok = self.tp.smallest(int(error is None), self.imports.pool.device)
            if not ok:
                logger.warning("request_id=%s: KV fetch failed: %s", entry.request_id, error)
                self.failed.setdefault(plan.step, []).append(entry.request_id)
        elapsed = time.perf_counter() - started
        self.seconds[plan.step] = self.seconds.get(plan.step, 0.0) + elapsed

    def report(self, output: ModelRunnerOutput) -> None:
        """What the step's imports came to, into its output."""
        output.kv_import_failed = self.failed.pop(output.step, [])
        output.kv_import_seconds = self.seconds.pop(output.step, 0.0)
