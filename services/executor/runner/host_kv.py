"""The executor's half of the prefix cache's host tier (`--kv-offloading-size`): a host copy of
KV blocks, one slot a block, and the copies each plan lists (services/scheduler/host_tier.py
keeps the books).

    slots  [num_slots, layers, 2 (K, V), block_size, kv_heads, head_dim bytes], pinned on CUDA

A slot holds one block's every layer contiguously, so each copy is one transfer a block. The
copies are queued on the compute stream as the executor takes a plan (or an addendum): after
the step launched before it and before its own forward pass, so a block is read after its last
write and written before its first read, and nothing on the host waits for them.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from services.executor.parallel.tensor_parallel import TensorParallel
from services.executor.runner.disk_kv import DiskKV, disk_blocks, open_disk_tier
from services.executor.runner.kv_cache import KVCacheLayout
from services.executor.runner.step_state import recorded_event
from shared.config import Config
from shared.protocol import HostCopies, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)
TO_HOST_BLOCKS = 64  # blocks staged on the device at a time on their way to the host


def copy_host_kv(pool: HostKVPool | None, plan: SchedulerOutput) -> None:
    """Queue the plan's host-tier copies (and its disk tier's jobs), if it has any."""
    if pool is not None and plan.host_copies is not None:
        pool.copy(plan.host_copies, plan.step)


def pinned(host: torch.Tensor) -> torch.Tensor:
    """`host`'s memory, page-locked where CUDA can (a DMA then moves it without a staging
    copy); as it is where CUDA cannot."""
    if torch.cuda.is_available():
        result = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0))
        if result:
            gib = host.numel() / 2**30
            logger.warning("could not page-lock %.1f GiB (CUDA error %d)", gib, result)
    return host


def unpinned(host: torch.Tensor) -> None:
    """Undo `pinned` (before the memory goes)."""
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


def tier_facts(pool: HostKVPool | None, block_bytes: int) -> dict[str, Any]:
    """ExecutorReady's fields of the host and disk tiers (`block_bytes`: over every rank)."""
    if pool is None:
        return {"num_host_blocks": 0, "host_block_bytes": block_bytes}
    disk = pool.disk
    return {
        "num_host_blocks": pool.num_slots,
        "host_block_bytes": block_bytes,
        "num_disk_blocks": pool.num_disk_blocks,
        "disk_blocks": disk.held() if disk is not None else [],
    }


class HostKVPool:
    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        num_slots: int,
        shared_file: str | None = None,
        on_device: bool = False,
    ) -> None:
        """`shared_file`: keep the slots in that file's memory (under /dev/shm: shared with
        other processes, which map it by name), else in this process's own; `on_device`: in
        the cache's device memory instead (a handover's, shared by CUDA IPC)."""
        # As bytes: [2, num_blocks, block_size, kv_heads, head_dim * itemsize], which every
        # cache dtype can be viewed as, and every copy kernel takes (not all take FP8). Each
        # slot once: grouped layers share one (a block holds one group's layers).
        unique = list({id(cache): cache for cache in kv_caches}.values())
        self.kv_caches = [cache.view(torch.uint8) for cache in unique]
        first = self.kv_caches[0]
        shape = (num_slots, len(unique), first.shape[0], *first.shape[2:])
        self.device = first.device
        self.disk: DiskKV | None = None  # the disk tier behind it (runner/disk_kv.py)
        self.num_disk_blocks = 0
        self.tp: TensorParallel | None = None  # the ranks whose disk reads must agree
        if on_device:
            self.slots = torch.empty(shape, dtype=torch.uint8, device=first.device)
        elif shared_file is None:
            self.slots = torch.empty(shape, dtype=torch.uint8, pin_memory=first.is_cuda)
        else:
            size = math.prod(shape)
            mapped = torch.from_file(shared_file, True, size, dtype=torch.uint8)
            self.slots = pinned(mapped).view(shape)

    @classmethod
    def sized(
        cls,
        config: Config,
        layout: KVCacheLayout,
        kv_caches: list[torch.Tensor],
        tp: TensorParallel,
    ) -> HostKVPool | None:
        """The pool of --kv-offloading-size GiB over all ranks (vLLM's meaning), with the
        disk tier behind it, or None without one."""
        size_gib = config.kv_offloading_size
        if size_gib is None:
            return None
        tp_size = tp.size
        num_slots = int(size_gib * 2**30) // (layout.bytes_per_block * tp_size)
        if num_slots < 1:
            raise ValueError(
                f"--kv-offloading-size {size_gib} GiB holds no block of"
                f" {layout.bytes_per_block * tp_size / 2**20:.1f} MiB"
            )
        pool = cls(kv_caches, num_slots)
        logger.info(
            "host KV tier: %d blocks x %d tokens = %d tokens (%.2f GiB on this rank)",
            num_slots,
            layout.block_size,
            num_slots * layout.block_size,
            num_slots * layout.bytes_per_block / 2**30,
        )
        pool.disk = open_disk_tier(config, pool.slots, layout.dtype, tp.rank, tp.size)
        pool.num_disk_blocks = disk_blocks(config, pool.disk, tp.size)
        pool.tp = tp
        if pool.disk is not None:
            logger.info(
                "disk KV tier: up to %d blocks (%.1f GiB) in %s, %d kept from before",
                pool.num_disk_blocks, config.kv_offloading_disk_size or 0,
                pool.disk.directory, len(pool.disk.held()),
            )  # fmt: skip
        return pool

    @property
    def num_slots(self) -> int:
        return self.slots.shape[0]

    def copy(self, copies: HostCopies, step: int) -> None:
        """One plan's (or addendum's) copies: evicted blocks to their slots (and to disk),
        then slots back into blocks; the disk tier's deletes and reads go to its thread."""
        disk = self.disk
        if disk is not None:
            if copies.disk_deletes:
                disk.delete(copies.disk_deletes)
            if copies.disk_loads:  # into reserved slots, after what was queued before
                disk.read(copies.disk_loads, recorded_event(self.device))
                if self.tp is not None and self.tp.size > 1:  # every rank's read, or a miss
                    agreed = len(copies.disk_loads)
                    disk.agree(agreed, lambda good: self.tp.smallest_each(good, self.device))
        if copies.disk_direct and disk is not None:
            self.to_disk(copies.disk_direct)
        if copies.offloads:
            self.to_host(copies.offloads, dict(copies.disk_stores))
        if copies.onloads:
            self._to_gpu(copies.onloads)

    def report(self, output: ModelRunnerOutput, idle: bool) -> None:
        """The disk reads done by now, into the step's output (`idle`: the step ran no rows,
        and waits for one read if any is out: DiskKV.report)."""
        if self.disk is not None:
            output.disk_loaded, output.disk_load_failed = self.disk.report(idle)
            output.disk_read_seconds = self.disk.read_seconds
            output.disk_write_seconds = self.disk.write_seconds

    @property
    def block_bytes(self) -> int:
        """One block's every layer, K and V: a slot's bytes."""
        return math.prod(self.slots.shape[1:])

    def to_host(
        self, pairs: list[tuple[int, int]], to_disk: dict[int, bytes] | None = None
    ) -> None:
        """Copy blocks to slots, (GPU block, host slot) pairs, a piece at a time (the pieces
        are staged on the device, outside the memory plan); and those whose slot `to_disk`
        names to the disk tier, under that key."""
        for first in range(0, len(pairs), TO_HOST_BLOCKS):
            self._to_host(pairs[first : first + TO_HOST_BLOCKS], to_disk or {})

    def _to_host(self, pairs: list[tuple[int, int]], to_disk: dict[int, bytes]) -> None:
        staged = self._staged([block for block, _ in pairs])
        if self.slots.device == staged.device:  # slots on the device (or the CPU): one copy
            self.slots.index_copy_(0, self._indices([slot for _, slot in pairs]), staged)
        else:
            for row, (_, slot) in enumerate(pairs):
                self.slots[slot].copy_(staged[row], non_blocking=True)
        rows = [row for row, (_, slot) in enumerate(pairs) if slot in to_disk]
        disk = self.disk
        if rows and disk is not None and disk.has_room(len(rows)):
            # A copy of its own: the slot may be reused before the thread writes it
            written = torch.empty(
                (len(rows), *staged.shape[1:]), dtype=torch.uint8, pin_memory=staged.is_cuda
            )
            written.copy_(staged[self._indices(rows)], non_blocking=True)
            keys = [to_disk[pairs[row][1]] for row in rows]
            disk.write(keys, written, recorded_event(self.device))

    def to_disk(self, pairs: list[tuple[int, bytes]]) -> None:
        """Write (GPU block, key) pairs to the disk tier straight from the GPU, a piece at a
        time, staged on the device (blocks the host tier had no slot for)."""
        disk = self.disk
        for first in range(0, len(pairs), TO_HOST_BLOCKS):
            piece = pairs[first : first + TO_HOST_BLOCKS]
            if disk is None or not disk.has_room(len(piece)):
                continue
            staged = self._staged([block for block, _ in piece])
            written = torch.empty(staged.shape, dtype=torch.uint8, pin_memory=staged.is_cuda)
            written.copy_(staged, non_blocking=True)
            disk.write([key for _, key in piece], written, recorded_event(self.device))

    def _staged(self, block_ids: list[int]) -> torch.Tensor:
        """[n, layers, 2, block_size, kv_heads, head_dim] bytes of the blocks, on the device:
        each block's layers together, as a slot holds them."""
        blocks = self._indices(block_ids)
        staged = torch.stack([cache.index_select(1, blocks) for cache in self.kv_caches])
        return staged.permute(2, 0, 1, 3, 4, 5).contiguous()

    def _to_gpu(self, pairs: list[tuple[int, int]]) -> None:
        shape = (len(pairs), *self.slots.shape[1:])
        staged = torch.empty(shape, dtype=self.slots.dtype, device=self.device)
        for row, (slot, _) in enumerate(pairs):
            staged[row].copy_(self.slots[slot], non_blocking=True)
        self.write([block for _, block in pairs], staged)

    def write(self, block_ids: list[int], staged: torch.Tensor) -> None:
        """Put blocks' bytes, as slots hold them ([n, layers, 2, ...] on the device), into
        the cache's blocks `block_ids`."""
        blocks = self._indices(block_ids)
        for layer, cache in enumerate(self.kv_caches):
            cache.index_copy_(1, blocks, staged[:, layer].transpose(0, 1))

    def _indices(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the device, copied from pinned memory so that the host does not wait."""
        host = torch.tensor(ids, dtype=torch.int64)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)
