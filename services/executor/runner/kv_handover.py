"""Prefill/decode disaggregation in the executor (--prefill-replicas; the scheduler's half is
services/scheduler/handover.py).

A prefill replica's executor copies each handed-over prompt's blocks (KVExport) to host slots,
queued on the compute stream right after the forward pass of the step that completes the
prompt (the request's first token is not sampled yet, so the copy is on its way before any
decode replica can ask), and serves them from a thread to the decode executor that asks
(shared/protocol/transfer.py). The slots
are a file under /dev/shm, page-locked: a decode executor on the same host maps it and copies
the blocks it is told of straight to its GPU (a shared fetch), then releases them; one that
cannot map it gets the bytes over the socket, in pieces of at most FETCH_BYTES. An export
leaves once fetched to its end, or, the slots being full, oldest first (never one lent).

A decode replica's executor fetches each KVImport of a plan as it takes it and copies the
bytes into the plan's blocks before its forward pass, on the compute stream (a block may
still be written by the step in flight, for a request that freed it). A fetch that fails (the
prefill executor gone or silent, the export dropped) is reported with the step's tokens
(ModelRunnerOutput.kv_import_failed). With tensor parallelism every rank fetches its own
heads from the same rank of the prefill engine, and the ranks agree on each fetch's fate.

NOTE: the fetch runs on the executor's thread as it takes the plan: the plan before it is
then on the device, but a slow fetch delays the steps after it.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import logging
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

from services.executor.parallel.tensor_parallel import TensorParallel
from services.executor.runner.host_kv import HostKVPool, copy_host_kv, pinned, unpinned
from shared.config import Config
from shared.ipc import Decoder, bind_router, connect_dealer, encode
from shared.protocol import (
    KVExport,
    KVFetch,
    KVFetchReply,
    KVImport,
    KVRelease,
    ModelRunnerOutput,
    SchedulerOutput,
)
from shared.wire_security import WireSecurity

logger = logging.getLogger(__name__)
EXPORT_BUFFER_BYTES = 4 << 30  # host memory a prefill rank holds exports in, at most
FETCH_BYTES = 32 << 20  # a fetch's piece over the socket: well under its message bound
FETCH_TIMEOUT_S = 5.0  # a decode rank's wait for one answer
SILENT_S = 10.0  # a prefill replica that did not answer is not asked again for this long
READ_BYTES = 128 << 20  # a shared fetch's piece on the GPU (staging is not in the memory plan)
EXPORT_WAIT_S = 3.0  # a prefill rank's wait for an export it has not taken yet
LEND_S = 30.0  # how long slots lent to a shared fetch stay out of the oldest-first drop
MAX_GONE = 4096  # exports remembered as fetched or dropped, to answer later asks at once
SHARED_DIR = Path("/dev/shm")
SHARED_PREFIX = "kvflow-kv-"  # then the process id and the rank


def move_kv(host: HostKVPool | None, handover: Handover, plan: SchedulerOutput) -> None:
    """The plan's copies to and from the host tier and its handovers' imports, queued before
    its forward pass."""
    copy_host_kv(host, plan)
    handover.run(plan)


def report_kv(host: HostKVPool | None, handover: Handover, output: ModelRunnerOutput) -> None:
    """What the step's imports and disk reads came to, into its output."""
    handover.report(output)
    if host is not None:
        host.report(output)


def reset_kv(host: HostKVPool | None, handover: Handover) -> None:
    """The executor dropped every step: so do the handovers, and the disk tier's jobs end
    (a new scheduler's books start from what its directory holds)."""
    handover.reset()
    if host is not None and host.disk is not None:
        host.disk.drain()


def rank_address(address: str, rank: int) -> str:
    """Tensor-parallel rank `rank`'s address of a replica's --kv-transfer-address entry."""
    if rank == 0:
        return address
    if address.startswith("tcp://"):
        host, port = address.rsplit(":", 1)
        return f"{host}:{int(port) + rank}"
    return f"{address}-{rank}"


def bind_address(address: str) -> str:
    """Where a prefill rank serves its exports: its entry, or every interface on the entry's
    port where the entry names a host (a pod's or container's name, which the decode replicas
    connect to: one list serves every replica)."""
    if not address.startswith("tcp://"):
        return address
    host, port = address[len("tcp://") :].rsplit(":", 1)
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return address if host == "localhost" else f"tcp://0.0.0.0:{port}"
    return address


def shared_slots_file(rank: int, size: int) -> str | None:
    """A new shared-memory file of `size` bytes for this process's export slots, its space
    reserved (a container's /dev/shm is often 64 MiB: writing past its end would kill us),
    removed at exit; None without a writable /dev/shm with room for it. Its name holds this
    host's name, the process id and a random part: files of this host's processes gone are
    removed first, and a name is never used twice (a decode rank may still map an old one)."""
    if not SHARED_DIR.is_dir() or not os.access(SHARED_DIR, os.W_OK):
        return None
    host = socket.gethostname()
    for stale in SHARED_DIR.glob(f"{SHARED_PREFIX}{host}-*"):
        pid = stale.name[len(f"{SHARED_PREFIX}{host}-") :].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            stale.unlink(missing_ok=True)
    path = SHARED_DIR / f"{SHARED_PREFIX}{host}-{os.getpid()}-{rank}-{secrets.token_hex(4)}"
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(descriptor, 0, size)
    except OSError:
        path.unlink()
        gib = size / 2**30
        logger.info("%s has no room for %.2f GiB: KV handed over as bytes", SHARED_DIR, gib)
        return None
    finally:
        os.close(descriptor)
    atexit.register(path.unlink, missing_ok=True)
    return str(path)


@dataclass
class _Export:
    slots: list[int]  # in block order
    done: torch.cuda.Event | None  # the copy out of the GPU
    lent_until: float = 0.0  # to a shared fetch, until its release (or then)


class KVExports:
    """A prefill rank's handed-over blocks, until fetched."""

    def __init__(
        self, pool: HostKVPool, address: str, security: WireSecurity, shared_file: str | None
    ) -> None:
        self.pool = pool
        self.shared_file = shared_file
        self._free = list(range(pool.num_slots - 1, -1, -1))  # pops the lowest: runs stay runs
        self._held: OrderedDict[str, _Export] = OrderedDict()
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._cond = threading.Condition()
        self._socket = bind_router(zmq.Context.instance(), bind_address(address), security)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-exports", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def close(self) -> None:
        """Stop serving (the socket closes, so that the process can end)."""
        self._closing.set()
        self._thread.join(timeout=2)

    def add(self, exports: list[KVExport]) -> None:
        """Queue the copies of a step's exports (after its forward pass)."""
        for export in exports:
            with self._cond:  # computed again (preempted before its first token): the new one
                if export.request_id in self._held:
                    self._drop(export.request_id)
            slots = self._take_slots(export)
            if slots is None:
                continue
            self.pool.to_host(list(zip(export.block_ids, slots, strict=True)))
            done = torch.cuda.Event() if self.pool.device.type == "cuda" else None
            if done is not None:
                done.record()
            with self._cond:
                self._held[export.request_id] = _Export(slots, done)
                self._cond.notify_all()

    def _take_slots(self, export: KVExport) -> list[int] | None:
        count, now = len(export.block_ids), time.monotonic()
        with self._cond:
            droppable = [r for r, e in self._held.items() if e.lent_until < now]  # oldest first
            while len(self._free) < count and droppable:
                self._drop(droppable.pop(0))
            if len(self._free) < count:
                logger.warning(
                    "request_id=%s: no room to hand over %d blocks (%d slots, %d free)",
                    export.request_id, count, self.pool.num_slots, len(self._free),
                )  # fmt: skip
                self._note_gone(export.request_id)
                return None
            return [self._free.pop() for _ in range(count)]

    def _drop(self, request_id: str) -> None:
        self._free.extend(self._held.pop(request_id).slots)
        self._free.sort(reverse=True)
        self._note_gone(request_id)

    def _note_gone(self, request_id: str) -> None:
        self._gone[request_id] = None
        while len(self._gone) > MAX_GONE:
            self._gone.popitem(last=False)

    def _serve(self) -> None:
        decoder = Decoder(KVFetch | KVRelease, "KV exports")
        while not self._closing.is_set():
            if not self._socket.poll(100):
                continue
            identity, frame = self._socket.recv_multipart()
            message = decoder.decode(frame)
            if isinstance(message, KVRelease):
                with self._cond:
                    if message.request_id in self._held:
                        self._drop(message.request_id)
                continue
            if not isinstance(message, KVFetch):
                continue
            reply, data = self._answer(message)
            try:
                self._socket.send_multipart([identity, encode(reply), data], copy=False)
            except zmq.ZMQError:  # that decode executor is gone
                logger.warning("request_id=%s: its fetcher is gone", message.request_id)
        self._socket.close(linger=0)

    def _answer(self, fetch: KVFetch) -> tuple[KVFetchReply, Any]:
        """Where the blocks are (a shared fetch) or their bytes, once the export is in."""
        rid = fetch.request_id
        with self._cond:
            self._cond.wait_for(lambda: rid in self._held or rid in self._gone, EXPORT_WAIT_S)
            entry = self._held.get(rid)
        if entry is None:
            return KVFetchReply(
                error=f"no export of {rid!r} here (fetched, dropped, or never made)"
            ), b""
        if entry.done is not None:
            entry.done.synchronize()  # the copy out of the GPU is in
        end = fetch.first + fetch.count
        if not 0 <= fetch.first < end <= len(entry.slots):
            return KVFetchReply(error=f"blocks {fetch.first}..{end - 1} of {len(entry.slots)}"), b""
        reply = KVFetchReply(block_bytes=self.pool.block_bytes)
        with self._cond:
            if self._held.get(rid) is not entry:  # dropped meanwhile: its slots may be reused
                return KVFetchReply(error=f"the export of {rid!r} was dropped"), b""
            if fetch.shared:  # where the slots are; none where they are not shared
                if self.shared_file is not None:
                    entry.lent_until = time.monotonic() + LEND_S
                    reply.shared_file, reply.slots = (
                        self.shared_file,
                        entry.slots[fetch.first : end],
                    )
                return reply, b""
            data = self.pool.slots[entry.slots[fetch.first : end]]  # a copy of its own
            if end == len(entry.slots):  # fetched to its end: done
                self._drop(rid)
        return reply, data.numpy()


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
        # Each source's shared file mapped here, by its name (None: cannot be).
        self._files: dict[int, tuple[str, torch.Tensor | None]] = {}
        self._silent_until: dict[int, float] = {}  # sources not to be asked until then
        self._unshared: set[int] = set()  # sources whose slots this rank cannot map
        self._stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        self._decoder = Decoder(KVFetchReply, "KV fetch")

    def load(self, entry: KVImport) -> str | None:
        """Fetch the blocks and queue their copies into the cache; an error, or None."""
        if not 0 <= entry.source < len(self.addresses):
            return f"no prefill replica {entry.source}"
        if time.monotonic() < self._silent_until.get(entry.source, 0.0):
            return f"prefill replica {entry.source} did not answer lately"
        if entry.source in self._unshared:
            return self._load_bytes(entry)
        fetch = KVFetch(entry.request_id, entry.first, len(entry.block_ids), shared=True)
        reply, _ = self._ask(entry.source, fetch)
        if reply.error:
            return reply.error
        slab = self._mapped(entry.source, reply.shared_file) if reply.slots else None
        if slab is None:  # not shared, or not mappable from here: the bytes, piece by piece
            self._unshared.add(entry.source)
            return self._load_bytes(entry)
        if len(reply.slots) != len(entry.block_ids) or max(reply.slots) >= slab.shape[0]:
            return f"slots {reply.slots} do not hold {len(entry.block_ids)} blocks here"
        per_piece = max(READ_BYTES // self.pool.block_bytes, 1)
        for start in range(0, len(reply.slots), per_piece):
            staged = self._read(slab, reply.slots[start : start + per_piece])
            self.pool.write(entry.block_ids[start : start + per_piece], staged)
        self._send(entry.source, KVRelease(entry.request_id))
        return None

    def _read(self, slab: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """The slots' bytes on the device, read to the end (they may go back once this
        returns); on CUDA by a stream of their own, which the compute stream then waits for,
        so that the host waits for these copies alone."""
        shape = (len(slots), *self.pool.slots.shape[1:])
        if self._stream is None:
            return torch.cat([slab[a : a + b - s] for s, b, a in _runs(slots)]).view(shape)
        with torch.cuda.stream(self._stream):
            staged = torch.empty(shape, dtype=torch.uint8, device=self.pool.device)
            for start, stop, first in _runs(slots):  # one copy a run of adjacent slots
                staged[start:stop].copy_(slab[first : first + stop - start], non_blocking=True)
        self._stream.synchronize()
        compute = torch.cuda.current_stream()
        compute.wait_stream(self._stream)
        staged.record_stream(compute)
        return staged

    def _load_bytes(self, entry: KVImport) -> str | None:
        per_piece = max(FETCH_BYTES // self.pool.block_bytes, 1)
        for start in range(0, len(entry.block_ids), per_piece):
            block_ids = entry.block_ids[start : start + per_piece]
            fetch = KVFetch(entry.request_id, entry.first + start, len(block_ids))
            reply, data = self._ask(entry.source, fetch)
            if reply.error:
                return reply.error
            if reply.block_bytes != self.pool.block_bytes or len(data) != len(block_ids) * (
                self.pool.block_bytes
            ):
                return f"blocks of {reply.block_bytes} bytes; this rank's are otherwise"
            staged = torch.frombuffer(data, dtype=torch.uint8)
            staged = staged.view(len(block_ids), *self.pool.slots.shape[1:])
            self.pool.write(block_ids, staged.to(self.pool.device))
        return None

    def _ask(self, source: int, fetch: KVFetch) -> tuple[KVFetchReply, Any]:
        socket = self._socket(source)
        socket.send(encode(fetch))
        deadline = time.monotonic() + FETCH_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            if not socket.poll(int(left * 1000) + 1):
                break
            header, data = socket.recv_multipart(copy=False)
            reply = self._decoder.decode(header.bytes)
            if isinstance(reply, KVFetchReply):
                if reply.block_bytes not in (0, self.pool.block_bytes):
                    reply.error = f"blocks of {reply.block_bytes} bytes; this rank's are otherwise"
                return reply, data.buffer
        # An answer may still come: a new socket never mistakes it for a later one's.
        self._sockets.pop(source).close(linger=0)
        self._silent_until[source] = time.monotonic() + SILENT_S
        error = f"prefill replica {source} did not answer in {FETCH_TIMEOUT_S:.0f} s"
        return KVFetchReply(error=error), b""

    def _send(self, source: int, message: KVRelease) -> None:
        self._socket(source).send(encode(message))

    def _socket(self, source: int) -> zmq.Socket[Any]:
        if source not in self._sockets:
            address = self.addresses[source]
            self._sockets[source] = connect_dealer(
                zmq.Context.instance(), address, self.name, self.security
            )
        return self._sockets[source]

    def _mapped(self, source: int, path: str) -> torch.Tensor | None:
        """The prefill rank's shared slots ([slots, ...] bytes), mapped here once a file (a
        restarted rank's new file replaces its old one); None where this process cannot open
        it (another host, another /dev/shm)."""
        known = self._files.get(source)
        if known is not None and known[0] == path:
            return known[1]
        if known is not None and known[1] is not None:
            unpinned(known[1])
        slab = None
        with contextlib.suppress(OSError, RuntimeError):
            size = os.path.getsize(path)
            block = self.pool.block_bytes
            if size % block == 0:
                mapped = pinned(torch.from_file(path, True, size, dtype=torch.uint8))
                slab = mapped.view(size // block, *self.pool.slots.shape[1:])
        self._files[source] = (path, slab)
        return slab


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(start, stop, first slot) of each run of consecutive slots in `slots`."""
    runs: list[tuple[int, int, int]] = []
    for index, slot in enumerate(slots):
        if runs and slot == runs[-1][2] + index - runs[-1][0]:
            runs[-1] = (runs[-1][0], index + 1, runs[-1][2])
        else:
            runs.append((index, index + 1, slot))
    return runs


class Handover:
    """An executor rank's part in handovers: exports (a prefill replica), imports (a decode
    replica), or neither (the server is not disaggregated)."""

    def __init__(
        self,
        exports: KVExports | None,
        imports: KVImports | None,
        tp: TensorParallel,
        device: torch.device,
    ) -> None:
        self.exports = exports
        self.imports = imports
        self.tp = tp
        self.device = device
        self.failed: dict[int, list[str]] = {}  # plan step -> its requests' failed imports
        self.to_export: dict[int, list[KVExport]] = {}  # plan step -> after its forward pass
        self.seconds: dict[int, float] = {}  # plan step -> the time its imports took

    @classmethod
    def start(cls, config: Config, kv_caches: list[torch.Tensor], tp: TensorParallel) -> Handover:
        """This rank's part (none where the server is not disaggregated)."""
        device = kv_caches[0].device
        if not config.prefill_replicas:
            return cls(None, None, tp, device)
        security = WireSecurity.of(config)
        addresses = [rank_address(a, tp.rank) for a in config.addresses("kv_transfer_address")]
        if len(addresses) != config.data_parallel_size:
            raise ValueError("--prefill-replicas needs --kv-transfer-address, one per replica")
        if config.replica >= config.prefill_replicas:
            name = f"r{config.replica}-executor-{tp.rank}"
            imports = KVImports(HostKVPool(kv_caches, 0), addresses, security, name)
            return cls(None, imports, tp, device)
        block_bytes = HostKVPool(kv_caches, 0).block_bytes
        num_slots = min(max(EXPORT_BUFFER_BYTES // block_bytes, 1), kv_caches[0].shape[1])
        shared_file = shared_slots_file(tp.rank, num_slots * block_bytes)
        pool = HostKVPool(kv_caches, num_slots, shared_file)
        logger.info(
            "handing over KV from %s: up to %d blocks held (%.2f GiB%s)",
            addresses[config.replica], num_slots, num_slots * block_bytes / 2**30,
            f", shared at {shared_file}" if shared_file else "",
        )  # fmt: skip
        exports = KVExports(pool, addresses[config.replica], security, shared_file)
        return cls(exports, None, tp, device)

    def run(self, plan: SchedulerOutput) -> None:
        """The plan's imports, as the executor takes it; its exports wait for its step."""
        if self.exports is not None and plan.kv_exports:
            self.to_export.setdefault(plan.step, []).extend(plan.kv_exports)
        if not plan.kv_imports:
            return
        started = time.perf_counter()
        for entry in plan.kv_imports:
            error = self._load(entry)
            ok = self.tp.smallest(int(error is None), self.device)
            if not ok:
                logger.warning("request_id=%s: KV fetch failed: %s", entry.request_id, error)
                self.failed.setdefault(plan.step, []).append(entry.request_id)
        elapsed = time.perf_counter() - started
        self.seconds[plan.step] = self.seconds.get(plan.step, 0.0) + elapsed

    def _load(self, entry: KVImport) -> str | None:
        """One import: an error, or None once its copies are queued."""
        if self.imports is None:
            return "this replica fetches no KV (not a decode replica)"
        try:
            return self.imports.load(entry)
        except Exception as exc:  # a bad answer must fail this request, not the executor
            logger.exception("request_id=%s: KV fetch broke", entry.request_id)
            return f"{type(exc).__name__}: {exc}"

    def after_forward(self, step: int) -> None:
        """Step `step`'s forward pass is queued: copy out the prompts it completed."""
        exports = self.to_export.pop(step, None)
        if exports and self.exports is not None:
            self.exports.add(exports)

    def reset(self) -> None:
        """The executor dropped every step (a new scheduler): their handovers go too."""
        self.to_export.clear()
        self.failed.clear()
        self.seconds.clear()

    def report(self, output: ModelRunnerOutput) -> None:
        """What the step's imports came to, into its output."""
        output.kv_import_failed = self.failed.pop(output.step, [])
        output.kv_import_seconds = self.seconds.pop(output.step, 0.0)
