"""The prefix cache's host tier (services/scheduler/host_tier.py): least recently used slots,
pins that keep a plan's reads from its own writes, and what the KV events hear of it.
tests/unit/test_scheduler_properties.py replays its copies against a fake KV cache."""

from __future__ import annotations

from services.scheduler.block_pool import BlockEvents
from services.scheduler.host_tier import HostTier
from services.scheduler.kv_cache_manager import KVCacheManager


def test_evicted_blocks_take_the_least_recently_used_slots() -> None:
    lost: list[bytes] = []
    tier = HostTier(2, lost.append)
    assert tier.store(5, b"a") and tier.store(6, b"b")
    assert tier.take_copies() == ([(5, 0), (6, 1)], [])
    tier.pin([b"a"])  # a hit on "a": now the most recently used
    tier.take_copies()
    assert tier.store(7, b"c")  # takes "b"'s slot
    assert lost == [b"b"] and b"a" in tier and b"b" not in tier
    assert tier.take_copies() == ([(7, 1)], [])
    tier.check_invariants()


def test_a_slot_the_plan_restores_is_not_overwritten_by_the_same_plan() -> None:
    tier = HostTier(1)
    tier.store(5, b"a")
    tier.take_copies()
    tier.pin([b"a"])
    assert not tier.store(6, b"b")  # the only slot is read by this plan: the block is dropped
    tier.restore(b"a", 7)
    assert tier.take_copies() == ([], [(0, 7)])
    assert tier.num_dropped == 1
    assert tier.store(8, b"c")  # the next plan may take it
    assert tier.take_copies() == ([(8, 0)], [])


def test_a_hash_the_tier_holds_is_still_the_engines() -> None:
    """The KV events report a block evicted from the GPU only once the host tier lets it go."""
    events = BlockEvents()
    kv = KVCacheManager(2, 4, True, events)
    kv.add_host_tier(1)
    blocks = kv.pool.allocate(2)
    for block, key in zip(blocks, (b"a", b"b"), strict=True):
        kv.pool.cache(block, key)
    kv.pool.release(blocks[::-1])  # both evictable, "b" the older
    events.take()
    kv.pool.allocate(1)  # evicts "b" into the tier: still held
    assert events.take() == ([], [])
    kv.take_copies()
    kv.pool.allocate(1)  # evicts "a" into the tier, which lets "b" go
    assert events.take() == ([], [b"b"])
    kv.pool.check_invariants()
    assert kv.host is not None
    kv.host.check_invariants()
