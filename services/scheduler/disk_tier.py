"""The prefix cache's disk tier (`--kv-offloading-disk-path`), behind the host tier: the books
of which block hashes the executor's directory holds, least recently used first.

Every block the host tier takes from the GPU is also written to disk (write-through, from the
same staged copy; a hash the directory holds already is not written again), so the host tier
drops its least recently used entries freely: whatever it drops is on disk. A block evicted
when every host slot is pinned by the plan goes to disk straight from the GPU. The directory
outlives the server, and the executor reports what it holds at start (`ExecutorReady`).

A prefix found on disk comes back in two hops, never on the step that needs it:

    plan k     disk -> host slot    the waiting request is not admitted; its hashes' files
                                    are read into host slots it reserves, on the executor's
                                    I/O threads while the GPU runs step k and those after
    report j   each read is good (checksum) or a miss, reported with the first step collected
               once it is done (j >= k): good ones join the host tier
    plan j+n   host slot -> GPU     the request is admitted with host-tier hits, as any other

While reads are out and nothing else runs, the engine still sends plans (with no rows: their
steps wait a little for the reads, `reading`), so that it collects their reports.

A read that fails (the file is gone or corrupted) is a miss and nothing else: the request
computes those blocks. A hash being read is not evicted from the books.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable


class DiskTier:
    def __init__(
        self,
        num_blocks: int,
        held: Iterable[bytes] = (),
        lost: Callable[[bytes], None] | None = None,
    ) -> None:
        """`held`: the hashes the directory holds from before, least recently written first
        (beyond `num_blocks`, the oldest are deleted); `lost`: told of each hash it drops."""
        self.num_blocks = num_blocks
        self.lost = lost
        # Whether the host tier holds a hash: kept here past others, since the host tier may
        # drop it next and must find it on disk (HostTier sets it).
        self.in_host: Callable[[bytes], bool] = lambda block_hash: False
        self._hashes: OrderedDict[bytes, None] = OrderedDict.fromkeys(held)
        self._loading: set[bytes] = set()
        self._waiting: dict[str, set[bytes]] = {}  # request -> its hashes being read
        self._deletes: list[bytes] = []
        self._stores: list[tuple[int, bytes]] = []  # (host slot, hash)
        self._direct: list[tuple[int, bytes]] = []  # (GPU block, hash): no host slot
        self._loads: list[tuple[bytes, int]] = []  # (hash, host slot)
        self.num_stored = 0  # blocks written since start
        self.num_loaded = 0  # blocks read back into the host tier
        self.num_misses = 0  # reads that found no good file
        self.read_seconds = 0.0  # the executor's time on files (its newest report)
        self.write_seconds = 0.0
        self._trim()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def keep(self, slot: int, block_hash: bytes) -> None:
        """The host tier took a block from the GPU into `slot`: write it through, unless the
        directory holds its hash already."""
        if block_hash in self._hashes:
            self._hashes.move_to_end(block_hash)
            return
        self._hashes[block_hash] = None
        self._stores.append((slot, block_hash))
        self.num_stored += 1
        self._trim()

    def keep_direct(self, block: int, block_hash: bytes) -> bool:
        """The GPU evicts `block` and the host tier has no slot for it: write it to disk
        straight from the GPU (unless held already). Whether the disk holds it now."""
        if block_hash in self._hashes:
            self._hashes.move_to_end(block_hash)
            return True
        self._hashes[block_hash] = None
        self._direct.append((block, block_hash))
        self.num_stored += 1
        self._trim()
        return block_hash in self._hashes

    def touch(self, block_hash: bytes) -> None:
        """The host tier used the hash again: the most recently used here too, if held."""
        if block_hash in self._hashes:
            self._hashes.move_to_end(block_hash)

    def fetch(
        self, request_id: str, hashes: list[bytes], reserve: Callable[[bytes], int | None]
    ) -> bool:
        """Read those of `hashes` (all held here) that are not on their way already into host
        slots that `reserve` gives (None: none free, and the rest stay on disk); whether the
        request now waits for any read."""
        waiting = self._waiting.get(request_id, set())
        for block_hash in hashes:
            if block_hash not in self._loading:
                slot = reserve(block_hash)
                if slot is None:
                    break
                self._loading.add(block_hash)
                self._hashes.move_to_end(block_hash)
                self._loads.append((block_hash, slot))
            waiting.add(block_hash)
        if waiting:
            self._waiting[request_id] = waiting
        return bool(waiting)

    def reading(self) -> bool:
        """Whether reads are out, not reported yet."""
        return bool(self._loading)

    def waits(self, request_id: str) -> bool:
        """Whether the request waits for reads it started (it is not admitted until then)."""
        return request_id in self._waiting

    def reported(self, loaded: list[bytes], failed: list[bytes]) -> None:
        """A step's reads came back: `failed` ones are misses, gone from the books."""
        self._loading.difference_update(loaded)
        self._loading.difference_update(failed)
        self.num_loaded += len(loaded)
        self.num_misses += len(failed)
        for block_hash in failed:
            if block_hash in self._hashes:
                del self._hashes[block_hash]
                if self.lost is not None:
                    self.lost(block_hash)
        done = {*loaded, *failed}
        for request_id in [r for r, hashes in self._waiting.items() if hashes <= done]:
            del self._waiting[request_id]
        for hashes in self._waiting.values():
            hashes -= done

    def abandon(self) -> list[bytes]:
        """The executor dropped every step, its reads' reports with them: the hashes being
        read, which stay in the books (their files are as good as before)."""
        loading, self._loading = list(self._loading), set()
        self._waiting.clear()
        return loading

    def take_copies(self) -> tuple[list[bytes], list[tuple[int, bytes]], list[tuple[bytes, int]]]:
        """(deletes, stores, loads) of the plan built since the last call (`take_direct`: its
        writes straight from the GPU)."""
        copies = (self._deletes, self._stores, self._loads)
        self._deletes, self._stores, self._loads = [], [], []
        return copies

    def take_direct(self) -> list[tuple[int, bytes]]:
        direct, self._direct = self._direct, []
        return direct

    def _trim(self) -> None:
        """Drop the least recently used hashes past the bound: not those being read, and those
        the host tier holds last (a block read back from disk long ago may be in a host slot
        still, and nowhere else once the host tier drops it)."""
        while len(self._hashes) > self.num_blocks:
            victim = self._victim()
            if victim is None:
                return
            del self._hashes[victim]
            stores = [store for store in self._stores if store[1] != victim]
            direct = [store for store in self._direct if store[1] != victim]
            if len(stores) + len(direct) < len(self._stores) + len(self._direct):
                self._stores, self._direct = stores, direct  # not written yet: no delete
                self.num_stored -= 1
            else:
                self._deletes.append(victim)
            if self.lost is not None:
                self.lost(victim)

    def _victim(self) -> bytes | None:
        """The least recently used hash not being read, one the host tier lacks if any."""
        first = None
        for block_hash in self._hashes:
            if block_hash in self._loading:
                continue
            if not self.in_host(block_hash):
                return block_hash
            first = first or block_hash
        return first

    def check_invariants(self) -> None:
        assert len(self._hashes) <= max(self.num_blocks, len(self._loading)), "over its bound"
        assert self._loading <= self._hashes.keys(), "a hash read that the books dropped"
        for hashes in self._waiting.values():
            assert hashes and hashes <= self._loading, "a request waits for no read"
