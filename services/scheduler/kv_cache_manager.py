"""Per-request KV block allocation on top of the block pool, with automatic prefix caching,
and the prefix cache's host tier (`--kv-offloading-size`) behind it.

With a window (every layer of the model attends to its last `window` positions only), a
request's leading blocks that no query of it will read again are given back to the pool as it
advances: their place in its block list holds the null block, which is never allocated, read
or written. A request then holds about window / block_size blocks, whatever its length, and a
prefix hit needs only the blocks in the window before the first position to compute.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.block_pool import BlockEvents, BlockPool
from services.scheduler.host_tier import HostTier
from services.scheduler.request import Request
from services.scheduler.scheduler_config import SchedulerConfig
from shared.protocol import HostCopies, HostTierStats


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The KV blocks `num_tokens` tokens take."""
    return -(-num_tokens // block_size)


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
        window: int | None = None,
    ) -> None:
        """`window`: every layer's sliding window, whose passed blocks are freed (the module
        docstring)."""
        self.events = events
        self.host: HostTier | None = None
        self.pool = BlockPool(num_blocks, events)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_ids: dict[str, list[int]] = {}
        self.window = window
        # With a window: the block in place of those a request freed; its leading blocks freed
        self.null_block = self.pool.allocate(1)[0] if window is not None else -1
        self._num_skipped: dict[str, int] = {}
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
        return cls(
            config.num_blocks, config.block_size, config.enable_prefix_caching, events,
            config.kv_window,
        )  # fmt: skip

    def add_host_tier(self, num_blocks: int) -> None:
        """Keep what the GPU evicts in a host tier of `num_blocks` (none: 0, or without prefix
        caching, whose blocks it holds)."""
        if num_blocks and self.enable_prefix_caching:
            self.host = HostTier(num_blocks, self._lost)
            self.pool.spill = self.host.store

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
        if self.window is not None:
            return self._window_prefix(hashes)
        blocks = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _window_prefix(self, hashes: list[bytes]) -> list[int]:
        """The longest prefix whose blocks in the window before its end are cached (those
        before it: the null block), as `find_cached_prefix`."""
        found = [self.pool.lookup(block_hash) for block_hash in hashes]
        for end in range(len(found), 0, -1):
            first = self._first_needed(end * self.block_size)
            window = [block for block in found[first:end] if block is not None]
            if len(window) == end - first:
                return [self.null_block] * first + window
        return []

    def _first_needed(self, position: int) -> int:
        """The first block a query at `position` (or after) may read, with a window."""
        assert self.window is not None
        return max(position - self.window + 1, 0) // self.block_size

    def find_host_prefix(self, request: Request, num_cached: int) -> list[bytes]:
        """The hashes of the blocks after the `num_cached` found on the GPU that the host tier
        holds, in a row (stopping at one the GPU holds again: its own hit, later)."""
        if self.host is None:
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

    def record_prefix_lookup(self, num_queried: int, num_cached: int, num_restored: int) -> None:
        """Count one admission's lookup (a lookup that fails to get blocks is retried): tokens
        asked, and blocks found on the GPU and restored from the host tier."""
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
        hits = len(cached) + len(restored) + num_imported
        num_tokens = request.num_computed_tokens + hits * self.block_size + num_new_tokens
        if not hits and num_tokens <= len(held) * self.block_size:
            # Most decode steps: the last block has room, so only a newly full block to hash.
            self._cache_full_blocks(request, num_tokens)
            return True
        num_needed = self.num_blocks_for(num_tokens) - len(held) - len(cached)
        real = [block for block in cached if block != self.null_block]
        # Touching an evictable hit takes it out of the available count too.
        num_revived = sum(1 for block in real if self.pool.ref_cnt[block] == 0)
        if num_needed + num_revived > self.pool.num_available:
            return False
        self.pool.touch(real)
        if cached and cached[0] == self.null_block:  # a window's hit: those before it passed
            self._num_skipped[request.request_id] = cached.index(real[0]) if real else 0
        host = self.host
        if restored:
            assert host is not None, "restored blocks come from the host tier"
            host.pin(list(restored))  # before allocating: an eviction stores into the tier
        blocks = self.block_ids.setdefault(request.request_id, [])
        blocks.extend(cached)
        new_blocks = self.pool.allocate(max(num_needed, 0))
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
        return HostTierStats(
            num_blocks=self.host.num_slots,
            block_bytes=block_bytes,
            queries=self.host_queries,
            hits=self.host_hits,
            blocks_to_host=self.host.num_offloaded,
            blocks_to_gpu=self.host.num_onloaded,
        )

    def take_copies(self) -> HostCopies | None:
        """The host tier's copies for the plan built since the last call (HostTier)."""
        if self.host is None:
            return None
        offloads, onloads = self.host.take_copies()
        return HostCopies(offloads=offloads, onloads=onloads) if offloads or onloads else None

    def _lost(self, block_hash: bytes) -> None:
        """The host tier dropped a hash: gone from this engine unless the GPU holds it."""
        if self.events is not None and self.pool.lookup(block_hash) is None:
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
            if blocks[index] != self.null_block:  # one freed before it was hashed stays out
                self.pool.cache(blocks[index], request.block_hashes[index])
        self._num_cached_blocks[request.request_id] = max(start, end)

    def _free_passed(self, request: Request) -> None:
        """With a window: give back the request's leading blocks that none of its queries
        will read again (those before the window of its next position to compute)."""
        blocks = self.block_ids.get(request.request_id)
        if self.window is None or not blocks:
            return
        start = self._num_skipped.get(request.request_id, 0)
        end = min(self._first_needed(request.num_computed_tokens), len(blocks))
        if end <= start:
            return
        passed = [block for block in blocks[start:end] if block != self.null_block]
        blocks[start:end] = [self.null_block] * (end - start)
        self._num_skipped[request.request_id] = end
        self.pool.release(passed[::-1])

    def free(self, request: Request) -> None:
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
        if self.window is not None:
            refs[self.null_block] = 1  # held for good
        for request_id, blocks in self.block_ids.items():
            skipped = self._num_skipped.get(request_id, 0)
            assert all(block == self.null_block for block in blocks[:skipped]), "a passed block"
            real = [block for block in blocks if block != self.null_block]
            assert len(set(real)) == len(real), "a request holds a block twice"
            for block in real:
                refs[block] += 1
        assert refs == self.pool.ref_cnt, "reference counts disagree with request block lists"
