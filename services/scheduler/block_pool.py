"""A fixed pool of KV blocks with reference counts, a prefix-cache map and LRU eviction.

Every block is in exactly one of three states:

    free       ref 0, no hash   -> handed out first
    evictable  ref 0, hashed    -> still findable by prefix; evicted least recently used first
    referenced ref >= 1         -> in use by running requests (hashed or not)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class BlockEvents:
    """What the prefix cache gained and lost since the last `take`, for routers
    (--kv-events-address): each key's last change wins, so a key cached and evicted between two
    takes is reported evicted, and one evicted and cached again is reported cached."""

    def __init__(self) -> None:
        self._changes: dict[bytes, bool] = {}  # key -> cached (True) or evicted (False)

    def stored(self, key: bytes) -> None:
        self._changes[key] = True

    def removed(self, key: bytes) -> None:
        self._changes[key] = False

    def take(self) -> tuple[list[bytes], list[bytes]]:
        """(keys cached, keys evicted) since the last take."""
        changes, self._changes = self._changes, {}
        return [k for k, v in changes.items() if v], [k for k, v in changes.items() if not v]


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        events: BlockEvents | None = None,
        spill: Callable[[int, bytes], bool] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.events = events
        # Where an evicted block's KV may go on (services/scheduler/host_tier.py): True if
        # kept there, so that its hash is still this engine's.
        self.spill = spill
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pops 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._cached: dict[bytes, int] = {}  # hash -> block id
        self._unannounced: set[bytes] = set()  # cached keys the events do not report
        self.num_evictions = 0

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now (free, or evictable at the cost of a cache entry)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_referenced(self) -> int:
        return self.num_blocks - self.num_available

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self, num: int) -> list[int]:
        """Take `num` blocks, free ones first, then evicting the least recently used."""
        if num > self.num_available:
            raise RuntimeError(f"asked for {num} blocks, {self.num_available} available")
        blocks = []
        for _ in range(num):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                evicted_hash = self.block_hash[block]
                assert evicted_hash is not None, "an evictable block is always cached"
                del self._cached[evicted_hash]
                self.block_hash[block] = None
                self.num_evictions += 1
                kept = self.spill is not None and self.spill(block, evicted_hash)
                announced = evicted_hash not in self._unannounced
                self._unannounced.discard(evicted_hash)
                if self.events is not None and not kept and announced:
                    self.events.removed(evicted_hash)
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self._evictable[block]
            self.ref_cnt[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference on each block; unreferenced hashed blocks become evictable.

        Callers pass a request's blocks tail first, so that its last blocks (the least
        likely to be shared) are evicted before its first ones.
        """
        for block in blocks:
            if self.ref_cnt[block] <= 0:
                raise RuntimeError(f"double free of block {block}")
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                if self.block_hash[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None

    def cache(self, block: int, block_hash: bytes, announce: bool = True) -> None:
        """Register a full, referenced block under its prefix key (first writer wins); the
        events report it unless not `announce` (a key no router computes)."""
        if self.block_hash[block] is None and block_hash not in self._cached:
            self._cached[block_hash] = block
            self.block_hash[block] = block_hash
            if not announce:
                self._unannounced.add(block_hash)
            elif self.events is not None:
                self.events.stored(block_hash)

    def counts(self) -> tuple[int, int, int]:
        """(free, evictable, referenced)."""
        return len(self._free), len(self._evictable), self.num_referenced

    def check_invariants(self) -> None:
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & evictable, "a block is both free and evictable"
        for block in range(self.num_blocks):
            ref = self.ref_cnt[block]
            assert ref >= 0, f"block {block} has ref {ref}"
            hashed = self.block_hash[block] is not None
            assert (block in free) == (ref == 0 and not hashed), f"block {block} free state"
            assert (block in evictable) == (ref == 0 and hashed), f"block {block} evictable state"
            if hashed:
                assert self._cached[self.block_hash[block]] == block  # type: ignore[index]
        assert len(self._cached) == sum(h is not None for h in self.block_hash)
        assert sum(self.counts()) == self.num_blocks
