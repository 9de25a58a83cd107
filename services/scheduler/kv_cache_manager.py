"""Per-request KV block allocation on top of the block pool, with automatic prefix caching,
and the prefix cache's host tier (`--kv-offloading-size`) behind it.

With layer groups (shared/kv_groups.py), a request holds a block per group for each of its
logical blocks, in one list: logical block i of group g at i * groups + g. A group whose layers
attend to their last `window` positions only gives its leading blocks that no query of the
request will read again back to the pool as it advances: their places hold the null block,
which is never allocated, read or written. Such a group holds about window / block_size blocks
of a request, whatever its length; a prefix hit needs all of a full group's blocks and only
the window's before its end of a sliding one. Each group keys its blocks apart (`group_key`).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from services.scheduler.block_pool import BlockEvents, BlockPool
from services.scheduler.disk_tier import DiskTier
from services.scheduler.host_tier import HostTier
from services.scheduler.request import Request
from services.scheduler.scheduler_config import SchedulerConfig
from shared.protocol import HostCopies, HostTierStats, ModelRunnerOutput

RESTORED = -2  # in a prefix hit of layer groups: a block the host tier copies into a new one


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The KV blocks `num_tokens` tokens take."""
    return -(-num_tokens // block_size)


def group_key(block_hash: bytes, group: int) -> bytes:
    """A block's prefix-cache key in a group: the first group's is the prefix key itself (what
    routers compute and the KV events publish), another group's that key and its number."""
    return block_hash if group == 0 else block_hash + bytes([group])


def window_blocks(window: int, step_tokens: int, block_size: int) -> int:
    """The most blocks a request holds with a window: a step's queries (up to `step_tokens`)
    read the window before the first of them.

    NOTE: a request's computed count never falls below what it was when its blocks were last
    freed: a row verifying drafts is not planned again before its tokens are in, and then
    counts only the accepted ones past where it was."""
    return blocks_for(window - 1 + step_tokens, block_size) + 1


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        events: BlockEvents | None = None,
        windows: tuple[int | None, ...] = (None,),
    ) -> None:
        """`windows`: each layer group's sliding window (None: full attention), whose passed
        blocks are freed (the module docstring)."""
        self.events = events
        self.host: HostTier | None = None
        self.pool = BlockPool(num_blocks, events)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_ids: dict[str, list[int]] = {}
        self.windows, self.num_groups = windows, len(windows)
        # With a window: the block in place of those a request freed, and per request the
        # leading logical blocks each group freed
        sliding = any(window is not None for window in windows)
        self.null_block = self.pool.allocate(1)[0] if sliding else -1
        self._num_skipped: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are hashed
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache
        self.host_queries = 0  # prompt tokens looked up in the host tier (past the GPU's hits)
        self.host_hits = 0  # of which restored from it
        # Prefill/decode disaggregation: the requests whose imported blocks are not known
        # good yet: none of their blocks is cached until then.
        self.unconfirmed: set[str] = set()

    @classmethod
    def of(cls, config: SchedulerConfig, events: BlockEvents | None = None) -> KVCacheManager:
        """The manager of `config`'s pool, with its host and disk tiers."""
        kv = cls(
            config.num_blocks, config.block_size, config.enable_prefix_caching, events,
            config.kv_windows,
        )  # fmt: skip
        kv.add_host_tier(config.num_host_blocks, config.num_disk_blocks, config.disk_blocks)
        return kv

    def add_host_tier(
        self, num_blocks: int, num_disk_blocks: int = 0, on_disk: Sequence[bytes] = ()
    ) -> None:
        """Keep what the GPU evicts in a host tier of `num_blocks` (none: 0, or without prefix
        caching, whose blocks it holds), and behind it a disk tier of `num_disk_blocks` whose
        directory holds `on_disk` from before (services/scheduler/disk_tier.py; not with
        layer groups, whose keys it does not chain)."""
        if not (num_blocks and self.enable_prefix_caching):
            return
        disk = (
            DiskTier(num_disk_blocks, on_disk) if num_disk_blocks and self.num_groups == 1 else None
        )
        self.host = HostTier(num_blocks, self._lost, disk)
        self.pool.spill = self.host.store
        if disk is not None:
            disk.lost = self._lost  # after its start: what it trimmed then was never announced
            for block_hash in on_disk:  # held by this engine from the start, for the routers
                if block_hash in disk and self.events is not None:
                    self.events.stored(block_hash)

    @property
    def disk(self) -> DiskTier | None:
        return self.host.disk if self.host is not None else None

    def fetch_from_disk(self, request: Request, num_hits: int) -> bool:
        """Start reading the request's prefix blocks after its `num_hits` GPU and host hits
        that only the disk tier holds into the host tier; whether it waits for them (it is
        not admitted until they are reported: DiskTier). Once per admission: the host tier
        may drop some of them again before it is admitted, and then they are computed."""
        disk, host = self.disk, self.host
        if disk is None or host is None or request.fetched_from_disk:
            return False
        hashes, held = [], []  # to read; its hits in the host tier
        for index, block_hash in enumerate(
            request.block_hashes[: self._max_prefix_blocks(request)]
        ):
            if block_hash in host:
                held.append(block_hash)
            elif index >= num_hits:
                if self.pool.lookup(block_hash) is not None or block_hash not in disk:
                    break
                hashes.append(block_hash)
        if not hashes:
            return False
        host.pin(held)  # the slots read into are not those of its own hits
        request.fetched_from_disk = disk.fetch(request.request_id, hashes, host.reserve)
        return request.fetched_from_disk

    def abandon_disk_reads(self) -> None:
        """The executor dropped every step: the slots its reads were to fill are free again,
        and no request waits for them."""
        if self.host is not None and self.host.disk is not None:
            for block_hash in self.host.disk.abandon():
                self.host.arrived(block_hash, good=False)

    def reads_out(self) -> bool:
        """Whether disk reads are out, not reported yet (a later step reports them)."""
        return self.disk is not None and self.disk.reading()

    def waits_for_disk(self, request: Request) -> bool:
        return self.disk is not None and self.disk.waits(request.request_id)

    def disk_reported(self, result: ModelRunnerOutput) -> None:
        """A step's disk reads are done: good ones join the host tier."""
        if self.host is None or self.host.disk is None:
            return
        loaded, failed = result.disk_loaded, result.disk_load_failed
        self.host.disk.reported(loaded, failed)
        self.host.disk.read_seconds = result.disk_read_seconds
        self.host.disk.write_seconds = result.disk_write_seconds
        for block_hash in loaded:
            self.host.arrived(block_hash, good=True)
        for block_hash in failed:
            self.host.arrived(block_hash, good=False)

    def num_blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens.

        NOTE: at least one token is always left to compute, because the step that
        computes the last token is the one that produces the next token's logits. A request
        that asks for prompt logprobs computes its whole prompt: they come from its logits; so
        does an embed request, whose pooling may read every position's hidden state.
        """
        hashes = request.block_hashes[: self._max_prefix_blocks(request)]
        if self.windows != (None,):
            return self._group_prefix(hashes)
        blocks = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _group_prefix(self, hashes: list[bytes]) -> list[int]:
        """The longest prefix that every group holds what its queries after it read of (all of
        it, or a window's blocks before its end), on the GPU or in the host tier (RESTORED), as
        `find_cached_prefix` (the null block in place of what a window leaves out)."""
        found = [[self._group_hit(group_key(h, g)) for h in hashes] for g in self.windows_range]
        end = len(hashes)
        while end and (ends := [self._hit_end(found[g], end, g) for g in self.windows_range]):
            if min(ends) == end:
                break
            end = min(ends)
        blocks = []
        for index in range(end):
            for group, window in enumerate(self.windows):
                first = self._first_needed(end * self.block_size, window or 0)
                passed = window is not None and index < first
                block = found[group][index]
                blocks.append(self.null_block if passed or block is None else block)
        return blocks

    def _group_hit(self, key: bytes) -> int | None:
        """A group's block holding `key`: on the GPU, RESTORED where the host tier holds it."""
        block = self.pool.lookup(key)
        if block is None and self.host is not None and key in self.host:
            return RESTORED
        return block

    @property
    def windows_range(self) -> range:
        return range(self.num_groups)

    def _hit_end(self, found: list[int | None], end: int, group: int) -> int:
        """The longest prefix of at most `end` blocks that a group holds what it needs of."""
        window = self.windows[group]
        if window is None:
            return next((i for i, block in enumerate(found[:end]) if block is None), end)
        for last in range(end, 0, -1):
            first = self._first_needed(last * self.block_size, window)
            if all(block is not None for block in found[first:last]):
                return last
        return 0

    def _first_needed(self, position: int, window: int) -> int:
        """The first logical block a query at `position` (or after) may read in the window."""
        return max(position - window + 1, 0) // self.block_size

    def find_host_prefix(self, request: Request, num_cached: int) -> list[bytes]:
        """The hashes of the blocks after the `num_cached` found on the GPU that the host tier
        holds, in a row (stopping at one the GPU holds again: its own hit, later)."""
        if self.host is None or self.windows != (None,):  # else in the hits (RESTORED)
            return []
        hashes = []
        for block_hash in request.block_hashes[num_cached : self._max_prefix_blocks(request)]:
            if block_hash not in self.host or self.pool.lookup(block_hash) is not None:
                break
            hashes.append(block_hash)
        return hashes

    def _max_prefix_blocks(self, request: Request) -> int:
        params = request.sampling_params
        if not self.enable_prefix_caching or params.prompt_logprobs is not None or params.embed:
            return 0
        return (request.num_tokens - 1) // self.block_size

    def record_prefix_lookup(
        self, num_queried: int, cached: Sequence[int], restored: Sequence[bytes]
    ) -> None:
        """Count one admission's lookup (a lookup that fails to get blocks is retried): tokens
        asked, and blocks found on the GPU (`cached`; with layer groups, a logical block of
        which any group's is RESTORED counts as restored) and restored from the host tier."""
        groups = self.num_groups
        logical = [cached[i : i + groups] for i in range(0, len(cached), groups)]
        num_restored = len(restored) + sum(RESTORED in blocks for blocks in logical)
        num_cached = len(logical) - (num_restored - len(restored))
        num_hit, num_restored = num_cached * self.block_size, num_restored * self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += num_queried
            self.prefix_hits += num_hit
        if self.host is not None:
            self.host_queries += num_queried - num_hit
            self.host_hits += num_restored

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached: Sequence[int] = (),
        restored: Sequence[bytes] = (),
        num_imported: int = 0,
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens, after `cached` prefix hits
        on the GPU, the `restored` ones (hashes) that the host tier copies back into new
        blocks (`find_host_prefix`), and `num_imported` blocks a prefill engine hands over.

        Returns False, changing nothing, when the pool cannot supply them.
        """
        self._free_passed(request)
        held = self.block_ids.get(request.request_id, [])
        groups = self.num_groups  # each logical block is one block of each group
        hits = len(cached) // groups + len(restored) + num_imported
        num_tokens = request.num_computed_tokens + hits * self.block_size + num_new_tokens
        if not hits and num_tokens <= len(held) // groups * self.block_size:
            # Most decode steps: the last block has room, so only a newly full block to hash.
            self._cache_full_blocks(request, num_tokens)
            return True
        to_restore = [i for i, block in enumerate(cached) if block == RESTORED]  # with groups
        num_needed = self.num_blocks_for(num_tokens) * groups - len(held) - len(cached)
        num_needed += len(to_restore)
        real = [block for block in cached if block not in (self.null_block, RESTORED)]
        # Touching an evictable hit takes it out of the available count too.
        num_revived = sum(1 for block in real if self.pool.ref_cnt[block] == 0)
        if num_needed + num_revived > self.pool.num_available:
            return False
        self.pool.touch(real)
        if self.null_block in cached:  # a window's hit: its group's leading ones passed
            self._num_skipped[request.request_id] = [
                self._num_leading_null(cached[group::groups]) for group in range(groups)
            ]
        host = self.host
        keys = [group_key(request.block_hashes[i // groups], i % groups) for i in to_restore]
        if restored or keys:
            assert host is not None, "restored blocks come from the host tier"
            host.pin([*restored, *keys])  # before allocating: an eviction stores into the tier
        blocks = self.block_ids.setdefault(request.request_id, [])
        first = len(blocks)
        blocks.extend(cached)
        new_blocks = self.pool.allocate(max(num_needed, 0))
        for index, key, block in zip(to_restore, keys, new_blocks, strict=False):
            blocks[first + index] = block  # a group's hit in the host tier
            host.restore(key, block)  # type: ignore[union-attr]
        new_blocks = new_blocks[len(to_restore) :]
        blocks.extend(new_blocks)
        if host is not None:
            for block_hash, block in zip(restored, new_blocks, strict=False):
                host.restore(block_hash, block)
        if num_imported:
            self.unconfirmed.add(request.request_id)
        self._cache_full_blocks(request, num_tokens)
        return True

    def host_tier_stats(self, block_bytes: int) -> HostTierStats | None:
        if self.host is None:
            return None
        disk = self.host.disk
        return HostTierStats(
            num_blocks=self.host.num_slots,
            block_bytes=block_bytes,
            queries=self.host_queries,
            hits=self.host_hits,
            blocks_to_host=self.host.num_offloaded,
            blocks_to_gpu=self.host.num_onloaded,
            num_disk_blocks=disk.num_blocks if disk is not None else 0,
            blocks_to_disk=disk.num_stored if disk is not None else 0,
            blocks_from_disk=disk.num_loaded if disk is not None else 0,
            disk_misses=disk.num_misses if disk is not None else 0,
            disk_read_seconds=disk.read_seconds if disk is not None else 0.0,
            disk_write_seconds=disk.write_seconds if disk is not None else 0.0,
        )

    def take_copies(self) -> HostCopies | None:
        """The host tier's copies for the plan built since the last call (HostTier)."""
        if self.host is None:
            return None
        offloads, onloads = self.host.take_copies()
        copies = HostCopies(offloads=offloads, onloads=onloads)
        disk = self.host.disk
        if disk is not None:
            copies.disk_deletes, copies.disk_stores, copies.disk_loads = disk.take_copies()
            copies.disk_direct = disk.take_direct()
        return copies if any(msgspec.structs.astuple(copies)) else None

    def _lost(self, block_hash: bytes) -> None:
        """A tier dropped a hash: gone from this engine unless the GPU or another tier holds
        it."""
        tiers = [tier for tier in (self.host, self.disk) if tier is not None]
        held = self.pool.lookup(block_hash) is not None or any(block_hash in t for t in tiers)
        if self.events is not None and not held:
            self.events.removed(block_hash)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks this step fills, so later requests (even this step's) reuse them.

        NOTE: sharing within one step is safe because the executor writes every token's
        K/V into the cache before any attention of the same layer reads it.
        """
        if not self.enable_prefix_caching or request.request_id in self.unconfirmed:
            return
        blocks = self.block_ids[request.request_id]
        start = self._num_cached_blocks.get(request.request_id, 0)
        # A block whose last token is still being sampled has no hash yet: cached next time.
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for index in range(start, end):
            for group in range(self.num_groups):
                block = blocks[index * self.num_groups + group]
                if block != self.null_block:  # one freed before it was hashed stays out
                    key = group_key(request.block_hashes[index], group)
                    self.pool.cache(block, key, announce=group == 0)
        self._num_cached_blocks[request.request_id] = max(start, end)

    def _free_passed(self, request: Request) -> None:
        """Give back the request's leading blocks of each sliding group that none of its
        queries will read again (those before the window of its next position to compute)."""
        blocks = self.block_ids.get(request.request_id)
        if self.null_block < 0 or not blocks:
            return
        groups = self.num_groups
        skipped = self._num_skipped.setdefault(request.request_id, [0] * groups)
        passed = []
        for group, window in enumerate(self.windows):
            if window is None:
                continue
            end = min(
                self._first_needed(request.num_computed_tokens, window), len(blocks) // groups
            )
            for index in range(skipped[group] * groups + group, end * groups, groups):
                if blocks[index] != self.null_block:
                    passed.append(blocks[index])
                    blocks[index] = self.null_block
            skipped[group] = max(skipped[group], end)
        self.pool.release(passed[::-1])

    def _num_leading_null(self, blocks: Sequence[int]) -> int:
        return next((i for i, b in enumerate(blocks) if b != self.null_block), len(blocks))

    def free(self, request: Request) -> None:
        request.fetched_from_disk = False  # requeued, it may read from disk again
        blocks = self.block_ids.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_skipped.pop(request.request_id, None)
        self.unconfirmed.discard(request.request_id)
        self.pool.release([block for block in blocks[::-1] if block != self.null_block])

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-but-idle blocks count as free)."""
        return self.pool.num_referenced / self.pool.num_blocks

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.host is not None:
            self.host.check_invariants()
        refs = [0] * self.pool.num_blocks
        if self.null_block >= 0:
            refs[self.null_block] = 1  # held for good
        for request_id, blocks in self.block_ids.items():
            assert len(blocks) % self.num_groups == 0, "a logical block without every group's"
            skipped = self._num_skipped.get(request_id, [0] * self.num_groups)
            for group, count in enumerate(skipped):
                passed = blocks[group : count * self.num_groups : self.num_groups]
                assert all(block == self.null_block for block in passed), "a passed block"
            real = [block for block in blocks if block != self.null_block]
            assert len(set(real)) == len(real), "a request holds a block twice"
            for block in real:
                refs[block] += 1
        assert refs == self.pool.ref_cnt, "reference counts disagree with request block lists"
