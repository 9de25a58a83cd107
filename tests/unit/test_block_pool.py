"""BlockPool and KVCacheManager: reference counts, the prefix-cache map and LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.block_pool import BlockEvents, BlockPool
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from shared.block_hashes import prefix_block_keys
from shared.protocol import EngineRequest, SamplingParams

BLOCK_SIZE = 4


def checked(pool: BlockPool) -> BlockPool:
    """Assert the pool's invariants and that its three states add up to its size."""
    pool.check_invariants()
    assert sum(pool.counts()) == pool.num_blocks
    return pool


def key(n: int) -> bytes:
    return f"hash-{n}".encode()


def cached_pool(num_blocks: int, num_cached: int) -> tuple[BlockPool, list[int]]:
    """A pool whose first `num_cached` blocks were hashed, then released in allocation order."""
    pool = BlockPool(num_blocks)
    blocks = pool.allocate(num_cached)
    for n, block in enumerate(blocks):
        pool.cache(block, key(n))
    pool.release(blocks)
    return checked(pool), blocks


def make_request(request_id: str, token_ids: list[int]) -> Request:
    engine_request = EngineRequest(
        request_id=request_id, prompt_token_ids=token_ids, sampling_params=SamplingParams()
    )
    return Request(engine_request, max_tokens=16, block_size=BLOCK_SIZE)


def checked_manager(manager: KVCacheManager) -> KVCacheManager:
    manager.check_invariants()
    assert sum(manager.pool.counts()) == manager.pool.num_blocks
    return manager


# ---------------------------------------------------------------- BlockPool


def test_new_pool_is_all_free():
    pool = checked(BlockPool(5))
    assert pool.counts() == (5, 0, 0)
    assert pool.num_available == 5


def test_allocate_hands_out_distinct_blocks_with_one_reference():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    checked(pool)
    assert len(set(blocks)) == 3
    assert all(pool.ref_cnt[b] == 1 for b in blocks)
    assert pool.counts() == (2, 0, 3)


def test_allocate_more_than_available_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert checked(pool).counts() == (1, 0, 2)


def test_release_of_an_unhashed_block_makes_it_free():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.release(blocks)
    assert checked(pool).counts() == (3, 0, 0)


def test_touch_adds_a_reference_and_each_release_drops_one():
    pool = BlockPool(3)
    [block] = pool.allocate(1)
    pool.touch([block])
    assert checked(pool).ref_cnt[block] == 2
    pool.release([block])
    assert checked(pool).counts() == (2, 0, 1)
    pool.release([block])
    assert checked(pool).counts() == (3, 0, 0)


def test_double_free_raises():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(blocks)
    checked(pool)


def test_release_of_a_hashed_block_makes_it_evictable_and_still_findable():
    pool, [block] = cached_pool(3, 1)
    assert pool.counts() == (2, 1, 0)
    assert pool.lookup(key(0)) == block


def test_cache_first_writer_wins():
    pool = BlockPool(3)
    first, second = pool.allocate(2)
    pool.cache(first, key(0))
    pool.cache(second, key(0))
    checked(pool)
    assert pool.lookup(key(0)) == first
    assert pool.block_hash[second] is None
    pool.release([first, second])
    assert checked(pool).counts() == (2, 1, 0)  # the loser was never cached: it is free


def test_cache_keeps_a_blocks_first_key():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.cache(block, key(0))
    pool.cache(block, key(1))
    checked(pool)
    assert pool.lookup(key(0)) == block
    assert pool.lookup(key(1)) is None


def test_free_blocks_are_used_before_evicting_cached_ones():
    pool, cached = cached_pool(4, 2)
    fresh = pool.allocate(2)
    checked(pool)
    assert not set(fresh) & set(cached)
    assert pool.num_evictions == 0
    assert [pool.lookup(key(n)) for n in range(2)] == cached


def test_eviction_takes_the_least_recently_released_block_first():
    pool, blocks = cached_pool(3, 3)  # released in order blocks[0], [1], [2]
    [evicted] = pool.allocate(1)
    checked(pool)
    assert evicted == blocks[0]
    assert pool.lookup(key(0)) is None
    assert pool.lookup(key(1)) == blocks[1]
    assert pool.num_evictions == 1


def test_an_evicted_block_comes_back_unhashed():
    pool, [block] = cached_pool(1, 1)
    assert pool.allocate(1) == [block]
    assert pool.block_hash[block] is None
    pool.release([block])
    assert checked(pool).counts() == (1, 0, 0)


def test_touch_revives_an_evictable_block():
    pool, blocks = cached_pool(2, 2)
    pool.touch([blocks[0]])
    assert checked(pool).counts() == (0, 1, 1)
    assert pool.allocate(1) == [blocks[1]]  # the touched block is not evictable
    checked(pool)
    assert pool.lookup(key(0)) == blocks[0]


def test_touch_then_release_makes_a_block_most_recently_used():
    pool, blocks = cached_pool(3, 3)
    pool.touch([blocks[0]])
    pool.release([blocks[0]])
    checked(pool)
    assert pool.allocate(2) == [blocks[1], blocks[2]]
    assert pool.lookup(key(0)) == blocks[0]


def test_counts_add_up_through_a_mix_of_operations():
    pool = checked(BlockPool(6))
    a = pool.allocate(3)
    checked(pool)
    pool.cache(a[0], key(0))
    pool.cache(a[1], key(1))
    checked(pool)
    pool.touch([a[0]])
    checked(pool)
    pool.release(a[::-1])
    assert checked(pool).counts() == (4, 1, 1)
    b = pool.allocate(5)  # four free, then evicts key(1)
    assert checked(pool).counts() == (0, 0, 6)
    pool.release([*b, a[0]])
    assert checked(pool).counts() == (5, 1, 0)
    assert pool.lookup(key(0)) == a[0]
    assert pool.lookup(key(1)) is None


# ---------------------------------------------------------------- KVCacheManager


def test_manager_allocates_blocks_for_the_tokens_and_caches_only_full_ones():
    manager = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    request = make_request("a", list(range(10)))
    assert manager.allocate(request, 10)
    checked_manager(manager)
    blocks = manager.block_ids["a"]
    assert len(blocks) == 3
    assert [manager.pool.block_hash[b] is not None for b in blocks] == [True, True, False]


def test_manager_free_releases_tail_first_so_the_tail_is_evicted_first():
    manager = KVCacheManager(3, BLOCK_SIZE, enable_prefix_caching=True)
    request = make_request("a", list(range(12)))
    assert manager.allocate(request, 12)
    blocks = list(manager.block_ids["a"])
    manager.free(request)
    checked_manager(manager)
    assert manager.pool.counts() == (0, 3, 0)
    other = make_request("b", [99, 98, 97])
    assert manager.allocate(other, 3)
    checked_manager(manager)
    assert manager.block_ids["b"] == [blocks[2]]
    assert manager.pool.lookup(request.block_hashes[0]) == blocks[0]
    assert manager.pool.lookup(request.block_hashes[2]) is None


def test_manager_finds_a_finished_requests_prefix():
    manager = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    first = make_request("a", list(range(10)))
    manager.allocate(first, 10)
    blocks = list(manager.block_ids["a"])
    manager.free(first)
    second = make_request("b", [*range(8), 50, 51, 52])
    assert manager.find_cached_prefix(second) == blocks[:2]
    checked_manager(manager)


def test_manager_leaves_at_least_one_token_to_compute():
    manager = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    first = make_request("a", list(range(8)))
    manager.allocate(first, 8)
    manager.free(first)
    same = make_request("b", list(range(8)))
    assert len(manager.find_cached_prefix(same)) == 1  # the last block is recomputed


def test_manager_without_prefix_caching_hashes_nothing():
    manager = KVCacheManager(4, BLOCK_SIZE, enable_prefix_caching=False)
    request = make_request("a", list(range(8)))
    assert manager.allocate(request, 8)
    manager.free(request)
    checked_manager(manager)
    assert manager.pool.counts() == (4, 0, 0)
    assert manager.find_cached_prefix(make_request("b", list(range(9)))) == []


def test_manager_allocate_refuses_without_changing_anything():
    manager = KVCacheManager(2, BLOCK_SIZE, enable_prefix_caching=True)
    request = make_request("a", list(range(12)))
    assert not manager.allocate(request, 12)
    checked_manager(manager)
    assert manager.pool.counts() == (2, 0, 0)
    assert "a" not in manager.block_ids


def test_manager_counts_reviving_cached_hits_against_the_pool():
    manager = KVCacheManager(4, BLOCK_SIZE, enable_prefix_caching=True)
    first = make_request("a", list(range(8)))
    manager.allocate(first, 8)
    manager.free(first)  # two evictable blocks, two free
    long = make_request("b", list(range(17)))
    hits = manager.find_cached_prefix(long)
    assert len(hits) == 2
    # 5 blocks: 2 revived hits + 3 new, but only 4 blocks exist in all.
    assert not manager.allocate(long, 17 - 8, hits)
    checked_manager(manager)
    short = make_request("c", list(range(12)))
    hits = manager.find_cached_prefix(short)
    assert manager.allocate(short, 12 - 8, hits)
    checked_manager(manager)
    assert manager.block_ids["c"][:2] == hits
    assert manager.pool.counts() == (1, 0, 3)


def test_manager_shares_a_block_between_two_requests():
    manager = KVCacheManager(4, BLOCK_SIZE, enable_prefix_caching=True)
    first = make_request("a", list(range(6)))
    manager.allocate(first, 6)
    second = make_request("b", list(range(7)))
    hits = manager.find_cached_prefix(second)
    assert manager.allocate(second, 3, hits)
    checked_manager(manager)
    shared = manager.block_ids["a"][0]
    assert manager.block_ids["b"][0] == shared
    assert manager.pool.ref_cnt[shared] == 2
    manager.free(first)
    manager.free(second)
    checked_manager(manager)
    assert manager.pool.counts() == (3, 1, 0)


# ---------------------------------------------------------------- events for routers


def test_events_report_keys_cached_and_evicted_last_change_winning() -> None:
    events = BlockEvents()
    pool = BlockPool(2, events)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], key(0))
    pool.cache(blocks[1], key(0))  # a second writer of the same key: nothing new
    assert events.take() == ([key(0)], [])
    assert events.take() == ([], [])
    pool.cache(blocks[1], key(1))
    pool.release(blocks)
    (again,) = pool.allocate(1)  # evicts key(0), the least recently released
    assert events.take() == ([key(1)], [key(0)])
    pool.cache(again, key(0))  # cached again after its eviction: cached wins
    (other,) = pool.allocate(1)  # evicts key(1)
    pool.cache(other, key(2))
    pool.release([other])
    pool.allocate(1)  # evicts key(2) before any take: evicted wins
    stored, removed = events.take()
    assert stored == [key(0)] and sorted(removed) == sorted([key(1), key(2)])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("acrt"), st.integers(0, 7)), max_size=80))
def test_events_replayed_give_the_pools_cached_keys(ops: list[tuple[str, int]]) -> None:
    """A router that applies every batch holds exactly the keys the pool can find."""
    events = BlockEvents()
    pool = BlockPool(6, events)
    held: list[int] = []
    mirror: set[bytes] = set()

    def apply() -> None:
        stored, removed = events.take()
        mirror.update(stored)
        mirror.difference_update(removed)

    for op, n in ops:
        if op == "a" and pool.num_available:
            held += pool.allocate(1)
        elif op == "c" and held:
            pool.cache(held[n % len(held)], key(n))
        elif op == "r" and held:
            pool.release([held.pop(n % len(held))])
        elif op == "t":
            apply()
    apply()
    assert mirror == {k for k in pool.block_hash if k is not None}


def test_a_routers_prompt_keys_are_the_schedulers() -> None:
    tokens = list(range(3 * BLOCK_SIZE + 2))
    assert prefix_block_keys(tokens, BLOCK_SIZE) == make_request("r", tokens).block_hashes
    under_lora = prefix_block_keys(tokens, BLOCK_SIZE, lora_id=3)
    assert len(under_lora) == 3 and not set(under_lora) & set(prefix_block_keys(tokens, 4))
