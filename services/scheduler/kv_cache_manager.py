"""Per-request KV block allocation on top of the block pool, with automatic prefix caching."""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.block_pool import BlockEvents, BlockPool
from services.scheduler.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The KV blocks `num_tokens` tokens take."""
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        events: BlockEvents | None = None,
    ) -> None:
        self.pool = BlockPool(num_blocks, events)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_ids: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are hashed
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    def num_blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens.

        NOTE: at least one token is always left to compute, because the step that
        computes the last token is the one that produces the next token's logits. A request
        that asks for prompt logprobs computes its whole prompt: they come from its logits; so
        does an embed request, whose pooling may read every position's hidden state.
        """
        params = request.sampling_params
        if not self.enable_prefix_caching or params.prompt_logprobs is not None or params.embed:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_prefix_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count one admission's lookup (a lookup that fails to get blocks is retried)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_queried
            self.prefix_hits += num_hit

    def allocate(self, request: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after `cached` prefix hits).

        Returns False, changing nothing, when the pool cannot supply them.
        """
        held = self.block_ids.get(request.request_id, [])
        num_tokens = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        if not cached and num_tokens <= len(held) * self.block_size:
            # Most decode steps: the last block has room, so only a newly full block to hash.
            self._cache_full_blocks(request, num_tokens)
            return True
        num_needed = self.num_blocks_for(num_tokens) - len(held) - len(cached)
        # Touching an evictable hit takes it out of the available count too.
        num_revived = sum(1 for block in cached if self.pool.ref_cnt[block] == 0)
        if num_needed + num_revived > self.pool.num_available:
            return False
        self.pool.touch(list(cached))
        blocks = self.block_ids.setdefault(request.request_id, [])
        blocks.extend(cached)
        blocks.extend(self.pool.allocate(max(num_needed, 0)))
        self._cache_full_blocks(request, num_tokens)
        return True

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks this step fills, so later requests (even this step's) reuse them.

        NOTE: sharing within one step is safe because the executor writes every token's
        K/V into the cache before any attention of the same layer reads it.
        """
        if not self.enable_prefix_caching:
            return
        blocks = self.block_ids[request.request_id]
        start = self._num_cached_blocks.get(request.request_id, 0)
        # A block whose last token is still being sampled has no hash yet: cached next time.
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for index in range(start, end):
            self.pool.cache(blocks[index], request.block_hashes[index])
        self._num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        blocks = self.block_ids.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.release(blocks[::-1])

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-but-idle blocks count as free)."""
        return self.pool.num_referenced / self.pool.num_blocks

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs = [0] * self.pool.num_blocks
        for blocks in self.block_ids.values():
            assert len(set(blocks)) == len(blocks), "a request holds a block twice"
            for block in blocks:
                refs[block] += 1
        assert refs == self.pool.ref_cnt, "reference counts disagree with request block lists"
