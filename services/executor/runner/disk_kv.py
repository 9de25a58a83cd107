"""The executor's half of the prefix cache's disk tier (--kv-offloading-disk-path; the scheduler
keeps the books: services/scheduler/disk_tier.py): a directory of files, one a block, behind the
host tier (runner/host_kv.py), written and deleted by one I/O thread in the order plans list
them, and read by READ_THREADS others side by side.

    <path>/replica<R>-rank<T>/manifest.json   what the files hold: model and weights, dtypes,
                                              block size, a slot's shape, the key scheme, the
                                              rank; files written under another manifest are
                                              deleted at start, never read
    <path>/replica<R>-rank<T>/<key hex>.kv    HEADER (magic, format, key, length, crc32), then
                                              a host slot's bytes (a block's K and V of every
                                              layer: this rank's heads)

    delete  the books dropped the key
    write   the offload's rows, staged on the device, are copied to pinned memory on the
            compute stream; the thread waits for that copy, writes `<name>.tmp` and renames it
            over `<name>`: a crash leaves a whole file or a tmp file, removed at start
    read    into the host slot the scheduler reserved, once the device has done what was
            queued before the plan (an earlier onload may still read that slot), from the
            pinned copy of a write not on disk yet, else from the file; a file that is
            missing, short or fails its checksum is a miss (and deleted), never an error

Reads are reported with the first step collected once they are done (`report`), which waits
for none of them but in a step that ran no rows (the engine's only work is requests waiting for
reads: it sends empty plans while they are out), and there for one read at most IDLE_WAIT_S,
so that a plan queued behind is not held up long. With tensor parallelism each rank reads its
own heads' files, and the ranks agree on each read as they take the plan (`agree`, which waits
for the plan's reads there, holding up that step): good only where every rank's was.
Writes waiting for the disk are bounded (MAX_PENDING_BYTES): past that a write is dropped, and
a later read of it is a miss. The directory is locked (flock on `lock`): two engines never
share one.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

import torch

from shared.config import Config
from shared.model_config import resolve_model_source

logger = logging.getLogger(__name__)

MAGIC, FORMAT = b"KVFLOWKV", 1
HEADER = struct.Struct("<8sI32sQI")  # magic, format, key, payload bytes, crc32 of the payload
MAX_PENDING_BYTES = 1 << 30  # written to pinned memory, not yet to disk
# Files read side by side: one reader took 1.4 ms a 2.4 MB block from the page cache (H200
# host, 2026-12-05), most of it the checksum, and a prefix is tens of blocks.
READ_THREADS = 8
IDLE_WAIT_S = 0.01  # the most a step with no rows waits for a read (then the engine asks again)
KEY_SCHEME = "sha256 chain over int64 token ids (shared/block_hashes.py)"


class DiskKV:
    def __init__(self, directory: Path, manifest: dict[str, Any], slots: torch.Tensor) -> None:
        """`slots`: the host tier's slots, which reads fill ([num_slots, ...] uint8)."""
        self.directory = directory
        self.slots = slots
        self._writes: queue.Queue[Callable[[], None] | None] = queue.Queue()  # and deletes
        self._reads_queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._reads: list[tuple[bytes, Future[bool]]] = []  # not reported yet, oldest first
        # Written to pinned memory, not to disk yet: key -> (rows, row, copied event)
        self._unwritten: dict[bytes, tuple[torch.Tensor, int, Any]] = {}
        self._pending = 0  # their bytes
        self._lock = threading.Lock()
        self.num_failed = 0  # writes the file system refused
        self.read_seconds = 0.0  # the threads' time on files, since start (summed over readers)
        self.write_seconds = 0.0
        self._lock_directory()
        self._open(manifest)
        # One writer (writes and deletes in order); readers side by side, since a read's
        # file I/O and checksum let go of the GIL.
        workers = [(self._writes, "writes")] + [(self._reads_queue, "reads")] * READ_THREADS
        for jobs, name in workers:
            threading.Thread(
                target=_work, args=(jobs,), name=f"kv-disk-{name}", daemon=True
            ).start()
        queues = [jobs for jobs, _ in workers]
        self._threads_end = weakref.finalize(self, _stop, *queues)

    @property
    def block_bytes(self) -> int:
        return self.slots[0].numel()

    # ------------------------------------------------------------------ the plan's side

    def delete(self, keys: list[bytes]) -> None:
        self._writes.put(lambda: [_unlink(self._path(key)) for key in keys])

    def read(self, loads: list[tuple[bytes, int]], queued: Any) -> None:
        """Read (key, host slot) pairs once `queued` (a CUDA event, or None) has passed. Reads
        have threads of their own: they wait behind no write (one not on disk yet is read
        from its pinned copy)."""
        for key, slot in loads:
            future: Future[bool] = Future()
            self._reads.append((key, future))
            self._reads_queue.put(
                lambda k=key, s=slot, f=future: f.set_result(self._read(k, s, queued))
            )

    def agree(self, num_reads: int, smallest_each: Callable[[list[int]], list[int]]) -> None:
        """With tensor parallelism: wait for the last `num_reads` reads (the plan's) now, as
        the plan is taken (every rank at the same point, between the same collectives), and
        count a read good only where every rank's was (`smallest_each` over the ranks)."""
        first = len(self._reads) - num_reads
        reads = self._reads[first:]
        agreed = smallest_each([int(future.result()) for _, future in reads])
        self._reads[first:] = [
            (key, _done(bool(good))) for (key, _), good in zip(reads, agreed, strict=True)
        ]

    def has_room(self, num_blocks: int) -> bool:
        """Whether a write of `num_blocks` would be taken (else they are dropped: misses)."""
        with self._lock:
            room = self._pending + num_blocks * self.block_bytes <= MAX_PENDING_BYTES
        if not room:
            logger.debug("disk KV tier: %d blocks not written (the disk is behind)", num_blocks)
        return room

    def write(self, keys: list[bytes], rows: torch.Tensor, copied: Any) -> None:
        """Write `rows` (pinned, a slot's bytes each, filled once `copied` has passed) as the
        files of `keys`."""
        with self._lock:
            self._pending += rows.numel()
            for row, key in enumerate(keys):
                self._unwritten[key] = (rows, row, copied)
        self._writes.put(lambda: self._write(keys, rows, copied))

    def report(self, idle: bool = False) -> tuple[list[bytes], list[bytes]]:
        """(read, missed) keys of the reads done since the last report; `idle` (the step ran
        no rows): once one is, if any is out, or IDLE_WAIT_S has passed."""
        if idle and self._reads:
            futures = [future for _, future in self._reads]
            wait(futures, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        loaded, failed, left = [], [], []
        for key, future in self._reads:
            if not future.done():
                left.append((key, future))
            else:
                (loaded if future.result() else failed).append(key)
        self._reads = left
        return loaded, failed

    def held(self) -> list[bytes]:
        """The keys the directory holds, least recently written first (once every job queued
        before is done)."""
        self.drain()
        files = [(p.stat().st_mtime_ns, p.stem) for p in self.directory.glob("*.kv")]
        return [bytes.fromhex(stem) for _, stem in sorted(files) if _is_key(stem)]

    def drain(self) -> None:
        """Wait for every job queued (a new scheduler's books start from the directory)."""
        self._reads_queue.join()
        self._writes.join()
        self._reads = []

    # ------------------------------------------------------------------ the I/O threads

    def _write(self, keys: list[bytes], rows: torch.Tensor, copied: Any) -> None:
        try:
            if copied is not None:
                copied.synchronize()
            started = time.perf_counter()
            for key, row in zip(keys, rows.numpy(), strict=True):
                path = self._path(key)
                temporary = path.with_suffix(".tmp")
                try:
                    with open(temporary, "wb") as file:
                        file.write(HEADER.pack(MAGIC, FORMAT, key, row.nbytes, zlib.crc32(row)))
                        file.write(row.data)
                    os.replace(temporary, path)
                except OSError as exc:  # a full disk: this block is a miss later
                    _unlink(temporary)
                    self.num_failed += 1
                    if self.num_failed == 1:  # once: a full disk fails every write
                        logger.warning("disk KV tier: a write failed (%s): misses later", exc)
            self.write_seconds += time.perf_counter() - started
        finally:
            with self._lock:
                self._pending -= rows.numel()
                for key in keys:
                    if self._unwritten.get(key, (None,))[0] is rows:
                        del self._unwritten[key]

    def _read(self, key: bytes, slot: int, queued: Any) -> bool:
        """One read into `slot`; False for a miss, whatever went wrong (never raises)."""
        try:
            if queued is not None:
                queued.synchronize()
            started = time.perf_counter()
            with self._lock:
                unwritten = self._unwritten.get(key)
            if unwritten is not None:  # still on its way to disk
                rows, row, copied = unwritten
                if copied is not None:
                    copied.synchronize()
                self.slots[slot].copy_(rows[row])
                good = True
            else:
                good = self._read_file(key, self.slots[slot].numpy().reshape(-1))
            with self._lock:
                self.read_seconds += time.perf_counter() - started
            return good
        except Exception:
            logger.exception("disk KV tier: reading %s failed: a miss", key.hex())
            return False

    def _read_file(self, key: bytes, target: Any) -> bool:
        path = self._path(key)
        try:
            with open(path, "rb") as file:
                magic, version, stored_key, length, crc = HEADER.unpack(file.read(HEADER.size))
                whole = (magic, version, stored_key, length) == (MAGIC, FORMAT, key, target.nbytes)
                whole = whole and file.readinto(target) == length and not file.read(1)
        except FileNotFoundError:
            return False
        except (OSError, struct.error) as exc:
            logger.warning("disk KV tier: %s unreadable (%s): a miss", path.name, exc)
            whole = False
        if whole and zlib.crc32(target) == crc:
            return True
        logger.warning("disk KV tier: %s is corrupted: a miss, deleted", path.name)
        _unlink(path)
        return False

    # ------------------------------------------------------------------ the directory

    def _path(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}.kv"

    def _lock_directory(self) -> None:
        """Hold the directory's lock while this object lives (two engines writing and trimming
        one directory would each delete the other's files)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.directory / "lock", "a+b")  # noqa: SIM115 (held open)
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise RuntimeError(
                f"disk KV tier: {self.directory} is in use by another engine (each replica of"
                " each server needs a --kv-offloading-disk-path of its own)"
            ) from None

    def close(self) -> None:
        """Finish the queued jobs, end the threads and give the directory up."""
        self.drain()
        self._threads_end()
        self._lock_file.close()

    def _open(self, manifest: dict[str, Any]) -> None:
        """Take the directory: keep its files if they were written under `manifest`, else
        delete them; tmp files of an interrupted write go either way."""
        for leftover in self.directory.glob("*.tmp"):
            leftover.unlink(missing_ok=True)
        manifest_path = self.directory / "manifest.json"
        try:
            kept = json.loads(manifest_path.read_text()) == manifest
        except (OSError, ValueError):
            kept = False
        if kept:
            return
        stale = [p for p in self.directory.glob("*.kv") if _is_key(p.stem)]
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            logger.info(
                "disk KV tier: %d blocks in %s were written for another model or layout:"
                " deleted", len(stale), self.directory,
            )  # fmt: skip
        temporary = manifest_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(temporary, manifest_path)

    def check_room(self, size_bytes: int) -> None:
        """Warn where the file system cannot hold the tier's size."""
        held = sum(p.stat().st_size for p in self.directory.glob("*.kv"))
        free = shutil.disk_usage(self.directory).free + held
        if free < size_bytes:
            logger.warning(
                "disk KV tier: %s has %.1f GiB free for a tier of %.1f GiB: writes will fail"
                " (misses later) once it is full", self.directory, free / 2**30, size_bytes / 2**30,
            )  # fmt: skip


def open_disk_tier(
    config: Config, slots: torch.Tensor, kv_dtype: torch.dtype, rank: int = 0, tp_size: int = 1
) -> DiskKV | None:
    """Tensor-parallel rank `rank`'s disk tier of --kv-offloading-disk-path behind the host
    tier's `slots` (None without one); its manifest names what its files may be reused for."""
    if config.kv_offloading_disk_path is None or config.kv_offloading_disk_size is None:
        return None
    directory = Path(config.kv_offloading_disk_path) / f"replica{config.replica}-rank{rank}"
    manifest = {**_manifest(config, slots, kv_dtype), "tensor_parallel": [rank, tp_size]}
    disk = DiskKV(directory, manifest, slots)
    size = int(config.kv_offloading_disk_size * 2**30) // tp_size
    if size < disk.block_bytes:
        raise ValueError(
            f"--kv-offloading-disk-size {config.kv_offloading_disk_size} GiB holds no block of"
            f" {disk.block_bytes / 2**20:.1f} MiB"
        )
    disk.check_room(size)
    return disk


def disk_blocks(config: Config, disk: DiskKV | None, tp_size: int = 1) -> int:
    """The blocks the disk tier may hold (0: none): its size is over every rank, as the host
    tier's."""
    if disk is None or config.kv_offloading_disk_size is None:
        return 0
    return int(config.kv_offloading_disk_size * 2**30) // (disk.block_bytes * tp_size)


def _manifest(config: Config, slots: torch.Tensor, kv_dtype: torch.dtype) -> dict[str, Any]:
    """What the KV in the files depends on. With LoRA, a random nonce: adapter ids (part of
    the keys) are given in load order, which another start may not repeat."""
    model = resolve_model_source(config.model).path  # a folder, a .gguf file or a preset
    weights = sorted(model.iterdir()) if model.is_dir() else [model]
    return {
        "format": FORMAT,
        "keys": KEY_SCHEME,
        "model": str(model.resolve()),
        "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in weights if p.is_file()],
        "load_format": config.load_format,
        "seed": config.seed if config.load_format == "dummy" else None,
        "quantization": config.quantization,
        "dtype": config.dtype,
        "kv_dtype": str(kv_dtype),
        "device": config.device,
        "block_size": config.block_size,
        "slot_shape": list(slots.shape[1:]),
        "lora": os.urandom(8).hex() if config.enable_lora else None,
    }


def _work(jobs: queue.Queue[Callable[[], None] | None]) -> None:
    """An I/O thread: its jobs in order, until None; one that fails is logged (a miss later),
    never the end of the thread. It holds no job once done (a job holds its DiskKV, which
    must be collectable: its lock is the directory's)."""
    while (job := jobs.get()) is not None:
        try:
            job()
        except Exception:
            logger.exception("disk KV tier: a job failed")
        finally:
            del job
            jobs.task_done()


def _stop(*queues: queue.Queue[Callable[[], None] | None]) -> None:
    for jobs in queues:
        jobs.put(None)


def _done(result: bool) -> Future[bool]:
    future: Future[bool] = Future()
    future.set_result(result)
    return future


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:  # a read-only file system: the file stays, a miss if read
        logger.warning("disk KV tier: could not delete %s (%s)", path.name, exc)


def _is_key(stem: str) -> bool:
    return len(stem) == 64 and all(c in "0123456789abcdef" for c in stem)
