"""A decode replica's executor rank takes prompts' KV over (--prefill-replicas): it fetches
each KVImport of a plan from the same rank of the prefill replica (runner/kv_exports.py) as it
takes the plan, and copies the blocks into the plan's blocks before its forward pass, on the
compute stream (a block may still be written by the step in flight, for a request that freed
it). Shared slots are read where they are (a /dev/shm file mapped here, or GPU memory opened by
CUDA IPC); else the bytes come over the socket in pieces.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
import zmq

from services.executor.runner import cuda_ipc
from services.executor.runner.host_kv import HostKVPool, pinned, unpinned
from shared.ipc import Decoder, connect_dealer, encode
from shared.protocol import CudaSlots, KVFetch, KVFetchReply, KVImport, KVRelease
from shared.wire_security import WireSecurity

FETCH_BYTES = 32 << 20  # a fetch's piece over the socket: well under its message bound
FETCH_TIMEOUT_S = 5.0  # a decode rank's wait for one answer
SILENT_S = 10.0  # a prefill replica that did not answer is not asked again for this long
READ_BYTES = 128 << 20  # a shared fetch's piece on the GPU (staging is not in the memory plan)


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
        # Each source's shared slots here, by the file's name or the CUDA IPC handle (None:
        # cannot be mapped or opened here).
        self._slabs: dict[int, tuple[str | bytes, torch.Tensor | None]] = {}
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
        slab = self._slab(entry.source, reply) if reply.slots else None
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
        # An answer may still come: a new socket never mistakes it for a later one's. Its
        # slots are let go (a CUDA IPC mapping would keep a gone exporter's memory).
        self._sockets.pop(source).close(linger=0)
        self._drop_slab(source)
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

    def _slab(self, source: int, reply: KVFetchReply) -> torch.Tensor | None:
        """The prefill rank's shared slots ([slots, ...] bytes), in GPU memory or a file,
        opened here once each (a restarted rank's new ones replace its old); None where this
        process cannot open them (another host, another /dev/shm, a GPU it does not see)."""
        key = reply.cuda_slots.handle if reply.cuda_slots else reply.shared_file
        known = self._slabs.get(source)
        if known is not None and known[0] == key:
            return known[1]
        self._drop_slab(source)
        if reply.cuda_slots is not None:
            slab = self._opened(reply.cuda_slots)
        else:
            slab = self._mapped(reply.shared_file)
        self._slabs[source] = (key, slab)
        return slab

    def _drop_slab(self, source: int) -> None:
        """Let go of a source's shared slots (unmapped, or their CUDA IPC mapping closed once
        the last view goes)."""
        known = self._slabs.pop(source, None)
        if known is not None and known[1] is not None and not known[1].is_cuda:
            unpinned(known[1])

    def _opened(self, shared: CudaSlots) -> torch.Tensor | None:
        slab = cuda_ipc.open_shared(shared) if self.pool.device.type == "cuda" else None
        if slab is None or slab.shape[1:] != self.pool.slots.shape[1:]:
            return None
        return slab

    def _mapped(self, path: str) -> torch.Tensor | None:
        slab = None
        with contextlib.suppress(OSError, RuntimeError):
            size = os.path.getsize(path)
            block = self.pool.block_bytes
            if size % block == 0:
                mapped = pinned(torch.from_file(path, True, size, dtype=torch.uint8))
                slab = mapped.view(size // block, *self.pool.slots.shape[1:])
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
