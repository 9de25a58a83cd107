"""The disk tier's books (services/scheduler/disk_tier.py) with the host tier in front: blocks
written through once, the least recently used deleted past the bound, reads into reserved host
slots that join the host tier when good, and what the KV events hear of it.
tests/unit/test_scheduler_properties.py replays its copies against a fake directory."""

from __future__ import annotations

from services.scheduler.block_pool import BlockEvents
from services.scheduler.disk_tier import DiskTier
from services.scheduler.host_tier import HostTier
from services.scheduler.kv_cache_manager import KVCacheManager


def test_blocks_are_written_through_once_and_the_oldest_deleted_past_the_bound() -> None:
    disk = DiskTier(2, held=[b"old"])
    host = HostTier(1, disk=disk)
    assert host.store(5, b"a")
    host.take_copies()
    assert host.store(6, b"b")  # takes "a"'s slot: "a" is on disk
    assert b"a" not in host and b"a" in disk and b"old" not in disk
    assert disk.take_copies() == ([b"old"], [(0, b"a"), (0, b"b")], [])
    host.take_copies()
    assert host.store(7, b"a")  # on disk already: not written again
    assert disk.take_copies() == ([], [], [])
    host.check_invariants()


def test_a_block_read_back_joins_the_host_tier_and_a_miss_frees_its_slot() -> None:
    disk = DiskTier(8, held=[b"a", b"b"])
    host = HostTier(2, disk=disk)
    assert disk.fetch("r1", [b"a", b"b"], host.reserve)
    assert disk.fetch("r2", [b"b"], host.reserve)  # on its way already: waits for the same
    assert disk.take_copies() == ([], [], [(b"a", 0), (b"b", 1)])
    assert disk.waits("r1") and disk.waits("r2")
    disk.reported([b"a"], [b"b"])
    host.arrived(b"a", good=True)
    host.arrived(b"b", good=False)
    assert b"a" in host and b"b" not in host and b"b" not in disk  # a miss is gone
    assert not disk.waits("r1") and not disk.waits("r2")
    assert disk.num_loaded == 1 and disk.num_misses == 1
    host.check_invariants()


def test_a_block_the_host_tier_has_no_slot_for_goes_to_disk_from_the_gpu() -> None:
    disk = DiskTier(8)
    host = HostTier(1, disk=disk)
    assert host.store(5, b"a") and host.store(6, b"b")  # "a" pins the only slot
    assert b"b" not in host and b"b" in disk
    assert disk.take_direct() == [(6, b"b")]
    assert disk.take_copies() == ([], [(0, b"a")], [])
    assert host.num_dropped == 0


def test_reads_that_fill_no_slot_wait_for_nothing() -> None:
    disk = DiskTier(8, held=[b"a"])
    host = HostTier(1, disk=disk)
    host.store(3, b"x")  # the only slot, pinned by the plan being built
    assert not disk.fetch("r1", [b"a"], host.reserve)
    assert not disk.waits("r1")


def test_reads_dropped_with_the_executors_steps_free_their_slots() -> None:
    kv = KVCacheManager(4, 4, True)
    kv.add_host_tier(2, num_disk_blocks=8, on_disk=[b"a", b"b"])
    assert kv.host is not None and kv.disk is not None
    kv.disk.fetch("r1", [b"a", b"b"], kv.host.reserve)
    kv.abandon_disk_reads()
    assert not kv.disk.waits("r1") and b"a" in kv.disk and b"b" in kv.disk
    kv.host.check_invariants()
    assert kv.disk.fetch("r1", [b"a", b"b"], kv.host.reserve)  # both slots free again


def test_reads_are_out_until_each_is_reported() -> None:
    """Reads are reported with whichever step is collected once they are done: until then the
    engine knows they are out (`reads_out`: engine_core sends empty plans while nothing else
    runs, so that it collects the reports)."""
    kv = KVCacheManager(4, 4, True)
    kv.add_host_tier(2, num_disk_blocks=8, on_disk=[b"a", b"b"])
    assert kv.host is not None and kv.disk is not None
    assert not kv.reads_out()
    kv.disk.fetch("r1", [b"a", b"b"], kv.host.reserve)
    first = kv.take_copies()
    assert first is not None and first.disk_loads == [(b"a", 0), (b"b", 1)]
    assert kv.take_copies() is None and kv.reads_out()  # nothing more to copy, both out
    kv.disk.reported([b"b"], [])
    kv.host.arrived(b"b", good=True)
    assert kv.reads_out() and kv.disk.waits("r1")  # "a" still out
    kv.disk.reported([b"a"], [])
    kv.host.arrived(b"a", good=True)
    assert not kv.reads_out() and not kv.disk.waits("r1")
    kv.host.check_invariants()


def test_a_hash_on_disk_is_still_the_engines() -> None:
    """The KV events report a block gone only once no tier holds it: not when the host tier
    drops it (it is on disk), nor when the disk trims a hash it found at start."""
    events = BlockEvents()
    kv = KVCacheManager(2, 4, True, events)
    kv.add_host_tier(1, num_disk_blocks=2, on_disk=[b"x", b"y", b"z"])  # "x" trimmed at once
    assert events.take() == ([b"y", b"z"], [])
    blocks = kv.pool.allocate(2)
    for block, key in zip(blocks, (b"a", b"b"), strict=True):
        kv.pool.cache(block, key)
    kv.pool.release(blocks[::-1])
    events.take()
    kv.pool.allocate(1)  # "b" to the host tier and disk; "y" trimmed from disk
    assert events.take() == ([], [b"y"])
    kv.take_copies()
    kv.pool.allocate(1)  # "a" in, "b" out of the host tier (on disk), "z" trimmed
    assert events.take() == ([], [b"z"])
    kv.pool.check_invariants()
    kv.host.check_invariants()


def test_the_disk_keeps_what_the_host_tier_holds_past_older_hashes() -> None:
    """A block read back from disk long ago and still in a host slot is not deleted while
    others can be: the host tier may drop it next, and then it must be on disk."""
    disk = DiskTier(2, held=[b"a"])
    host = HostTier(2, disk=disk)
    assert disk.fetch("r1", [b"a"], host.reserve)
    disk.take_copies()
    disk.reported([b"a"], [])
    host.arrived(b"a", good=True)
    assert host.store(5, b"x")
    host.take_copies()
    assert host.store(6, b"a")  # evicted from the GPU again: recent in the host tier only
    host.take_copies()
    assert host.store(7, b"y")  # the host tier drops "x"; the disk, past its bound, too
    assert b"a" in host and b"a" in disk and b"x" not in disk and b"y" in disk
    host.check_invariants()
