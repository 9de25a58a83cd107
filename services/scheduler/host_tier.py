"""The prefix cache's host-memory tier (`--kv-offloading-size`): where the KV of a cached block
goes when the GPU pool evicts it, found again by the same chained hash.

The scheduler only keeps the books: which hash sits in which host slot, least recently used
first. The executor moves the bytes, in the order each plan lists them (`take_copies`):

    offloads   GPU block -> host slot   of the blocks this plan's allocations evicted: copied
                                        before the step's forward pass overwrites them
    onloads    host slot -> GPU block   of the prefix hits this plan restores: copied before
                                        the forward pass reads them

Both run on the executor's compute stream, so a copy is ordered after every earlier step and
before its own step, with no wait on the host. Within one plan, offloads run first (a restored
block may go into a GPU block just evicted), and a slot read or written by the plan being built
is pinned: no later store of the same plan takes it (an offload would overwrite a slot before
the plan's onload reads it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from services.scheduler.disk_tier import DiskTier


class HostTier:
    def __init__(
        self,
        num_slots: int,
        lost: Callable[[bytes], None] | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        """`disk`: the disk tier behind it, which every block taken from the GPU is written
        through to, and which reads blocks back into slots this tier reserves."""
        self.num_slots = num_slots
        self.lost = lost  # told of each hash the tier drops (for the KV events)
        self.disk = disk
        if disk is not None:
            disk.in_host = self.__contains__
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, oldest first
        self._arriving: dict[bytes, int] = {}  # hash -> slot being read from disk into
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._offloads: list[tuple[int, int]] = []  # (GPU block, host slot)
        self._onloads: list[tuple[int, int]] = []  # (host slot, GPU block)
        self.num_offloaded = 0  # blocks copied to the host since start
        self.num_onloaded = 0  # blocks copied back (prefix hits in this tier)
        self.num_dropped = 0  # blocks the tier had no unpinned slot for

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def store(self, block: int, block_hash: bytes) -> bool:
        """The GPU pool evicts `block`: keep its KV under `block_hash`. False when every slot
        is pinned by the plan being built and there is no disk tier to write it to straight
        from the GPU (the block is then simply gone)."""
        if block_hash in self._slots:  # already here (evicted before, restored since): same KV
            self._slots.move_to_end(block_hash)
            self._touch_disk(block_hash)
            return True
        slot = self._take_slot()
        if slot is None:
            if self.disk is not None:  # to disk without a slot
                return self.disk.keep_direct(block, block_hash)
            self.num_dropped += 1
            return False
        self._slots[block_hash] = slot
        self._pinned.add(slot)
        self._offloads.append((block, slot))
        self.num_offloaded += 1
        if self.disk is not None:
            self.disk.keep(slot, block_hash)
        return True

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot for `block_hash` to be read into from disk (None: every slot is pinned);
        it joins the tier when the read is reported (`arrived`)."""
        slot = self._take_slot()
        if slot is not None:
            self._arriving[block_hash] = slot
        return slot

    def arrived(self, block_hash: bytes, good: bool) -> None:
        """The read into `block_hash`'s reserved slot is done; a `good` one is an entry now
        (unless the GPU evicted the same block here meanwhile: then the slot goes back)."""
        slot = self._arriving.pop(block_hash)
        if good and block_hash not in self._slots:
            self._slots[block_hash] = slot
        else:
            self._free.append(slot)

    def pin(self, hashes: list[bytes]) -> None:
        """Keep these entries through the plan being built (its prefix hits, before the GPU
        blocks they go to are allocated: an allocation may evict, and so store)."""
        for block_hash in hashes:
            self._slots.move_to_end(block_hash)
            self._pinned.add(self._slots[block_hash])
            self._touch_disk(block_hash)

    def restore(self, block_hash: bytes, block: int) -> None:
        """Copy the entry back into GPU `block` (pinned first by `pin`)."""
        slot = self._slots[block_hash]
        assert slot in self._pinned, "a restored slot is pinned until its plan is sent"
        self._onloads.append((slot, block))
        self.num_onloaded += 1

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(offloads, onloads) of the plan built since the last call, which ends its pins."""
        copies = (self._offloads, self._onloads)
        self._offloads, self._onloads, self._pinned = [], [], set()
        return copies

    def _touch_disk(self, block_hash: bytes) -> None:
        """Used again here: recent on disk too, so that the disk's trim, which passes over
        what this tier holds, does not scan past it."""
        if self.disk is not None:
            self.disk.touch(block_hash)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, slot in self._slots.items():  # least recently used first
            if slot not in self._pinned:
                del self._slots[block_hash]
                if self.lost is not None:
                    self.lost(block_hash)
                return slot
        return None

    def check_invariants(self) -> None:
        slots = list(self._slots.values()) + list(self._arriving.values())
        assert len(set(slots)) == len(slots), "two hashes share a host slot"
        assert not set(slots) & set(self._free), "a host slot is both free and held"
        assert len(slots) + len(self._free) == self.num_slots, "a host slot leaked"
        if self.disk is not None:
            self.disk.check_invariants()
