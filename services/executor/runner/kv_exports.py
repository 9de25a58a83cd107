"""A prefill replica's executor rank hands prompts' KV over (--prefill-replicas): it copies
each handed-over prompt's blocks (KVExport) to slots, queued on the compute stream right after
the forward pass of the step that completes the prompt, and serves them from a thread to the
decode executors that ask (shared/protocol/transfer.py; runner/kv_imports.py is the other side).

The slots are a file under /dev/shm, page-locked, which decode executors on the same host map;
or, with --kv-buffer-device cuda, GPU memory (out of the KV cache's share, where memory sizes
it: runner/kv_cache.py) that decode executors seeing that GPU open by CUDA IPC. Either is lent
to a shared fetch until its release; others get the bytes over the socket. An export leaves
once fetched to its end, or, the slots being full, oldest first (never one lent).
"""

from __future__ import annotations

import atexit
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

from services.executor.runner import cuda_ipc
from services.executor.runner.host_kv import HostKVPool
from services.executor.runner.kv_cache import KVCacheLayout
from shared.config import Config
from shared.ipc import Decoder, bind_router, encode
from shared.protocol import KVExport, KVFetch, KVFetchReply, KVRelease
from shared.wire_security import WireSecurity

logger = logging.getLogger(__name__)
EXPORT_WAIT_S = 3.0  # a prefill rank's wait for an export it has not taken yet
LEND_S = 30.0  # how long slots lent to a shared fetch stay out of the oldest-first drop
MAX_GONE = 4096  # exports remembered as fetched or dropped, to answer later asks at once
SHARED_DIR = Path("/dev/shm")
SHARED_PREFIX = "kvflow-kv-"  # then the process id and the rank


def exports_on_device(config: Config, device: torch.device) -> bool:
    """Whether this rank holds the KV it hands over in GPU memory (--kv-buffer-device)."""
    if config.replica >= config.prefill_replicas or config.kv_buffer_device != "cuda":
        return False
    if device.type != "cuda":
        raise ValueError("--kv-buffer-device cuda needs the prefill replica on a GPU")
    return True


def buffer_slots(config: Config, block_bytes: int) -> int:
    """The blocks a prefill rank holds handed-over KV in (--kv-buffer-size)."""
    return max(int(config.kv_buffer_size * 2**30) // block_bytes, 1)


def device_buffer_bytes(config: Config, layout: KVCacheLayout, device: torch.device) -> int:
    """The GPU memory this rank's handover slots take, which the KV cache's plan leaves free
    (0 unless they are on the GPU)."""
    if not exports_on_device(config, device):
        return 0
    return buffer_slots(config, layout.bytes_per_block) * layout.bytes_per_block


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
        self.cuda_slots = cuda_ipc.share(pool.slots) if pool.slots.is_cuda else None
        # Slots on the GPU are copied out as bytes on a stream of their own: the compute
        # stream's step in flight is not waited for.
        self._stream = torch.cuda.Stream(pool.device) if pool.slots.is_cuda else None
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
                if self.shared_file is not None or self.cuda_slots is not None:
                    entry.lent_until = time.monotonic() + LEND_S
                    reply.shared_file = self.shared_file or ""
                    reply.cuda_slots = self.cuda_slots
                    reply.slots = entry.slots[fetch.first : end]
                return reply, b""
            data = self._copied_out(entry.slots[fetch.first : end])
            if end == len(entry.slots):  # fetched to its end: done
                self._drop(rid)
        return reply, data.numpy()

    def _copied_out(self, slots: list[int]) -> torch.Tensor:
        """The slots' bytes in this process's memory, a copy of their own."""
        if self._stream is None:
            return self.pool.slots[slots]
        with torch.cuda.stream(self._stream):
            return self.pool.slots[slots].cpu()
