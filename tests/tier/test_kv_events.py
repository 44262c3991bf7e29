"""KV cache events of the tier inside vLLM's real TieringOffloadingManager.

With KV cache events enabled globally (``OffloadingConfig.enable_kv_cache_events``)
and on the tier (``enable_kv_events: true``), the tier reports BlockStored
(``OffloadingEvent(removed=False)``) for exactly the blocks that landed in it,
and BlockRemoved (``removed=True``) for files its loads quarantined (and, since
issue 32, for files a load found gone). A store that did not land and a tier
or process with events off report nothing.
"""

from __future__ import annotations

import os

import pytest
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium

from llmkv_fs.engine import Direction, Failure, Tally
from tests.kits.tier_kit import (
    make_keys,
    ours,
    resolve,
    start,
    store_burst_while_stalled,
    wait_until,
)
from tests.kits.volume_kit import flip_a_bit

HIT, MISS = LookupResult.HIT, LookupResult.MISS

# Our tier through vLLM's stack, in both io modes (I/O threads, worker processes).
pytestmark = pytest.mark.usefixtures("io_mode")


def tier_events(replica):
    with replica.manager.lock:
        return list(replica.tier.take_events())


def manager_storage_events(replica):
    """The events vLLM's connector collects (manager.take_events), minus the
    CPU primary tier's own."""
    with replica.manager.lock:
        events = list(replica.manager.take_events())
    return [e for e in events if e.medium is not Medium.CPU]


def keys_of(events, removed):
    keys = [k for e in events if e.removed is removed for k in e.keys]
    assert len(keys) == len(set(keys)), "a key reported twice"
    return set(keys)


def test_block_stored_for_landed_keys(disk_root, replicas):
    a = start(
        replicas, ours(disk_root, enable_kv_events=True, locality="REMOTE"), enable_kv_events=True
    )
    keys = make_keys(5, seed="events-stored")
    a.store(keys[:2])
    a.store(keys[2:])
    events = manager_storage_events(a)
    assert events and all(e.medium is Medium.STORAGE for e in events)
    assert all(e.locality is Locality.REMOTE for e in events)
    assert keys_of(events, removed=False) == set(keys)
    assert keys_of(events, removed=True) == set()
    assert tier_events(a) == []  # taken once


def test_stores_dropped_by_the_queue_bound_yield_no_event(disk_root, replicas):
    a = start(
        replicas,
        ours(
            disk_root,
            enable_kv_events=True,
            n_read_threads=1,
            n_write_threads=1,
            max_pending_store_blocks=4,
        ),
        enable_kv_events=True,
    )
    # Hold the volume "slow" while the burst is submitted: the two I/O threads
    # take one block each, the queue holds at most 4 more, the rest is refused.
    keys = make_keys(30, seed="events-burst")
    store_burst_while_stalled(a, keys)

    landed = {k for k in keys if os.path.exists(a.tier.engine.roots[0].layout.block_path(k))}
    dropped = a.tier.engine.counters[Direction.STORE, Failure.QUEUE_FULL]
    assert dropped > 0 and len(landed) == 30 - dropped
    events = tier_events(a)
    assert keys_of(events, removed=False) == landed
    assert keys_of(events, removed=True) == set()


def test_stores_refused_by_the_space_guard_yield_no_event(disk_root, replicas):
    a = start(
        replicas,
        ours(disk_root, enable_kv_events=True, min_free_bytes=1 << 60),
        enable_kv_events=True,
    )
    wait_until(lambda: not a.tier.engine.roots[0].guard.allows_store(), "the space guard to trip")
    keys = make_keys(3, seed="events-full")
    a.store(keys)
    assert a.tier.engine.counters[Direction.STORE, Failure.SPACE] == 3
    assert not any(os.path.exists(a.tier.engine.roots[0].layout.block_path(k)) for k in keys)
    assert tier_events(a) == []


def test_quarantined_load_yields_block_removed(disk_root, replicas):
    a = start(replicas, ours(disk_root, enable_kv_events=True), enable_kv_events=True)
    keys = make_keys(4, seed="events-flip")
    a.store(keys)
    assert keys_of(tier_events(a), removed=False) == set(keys)
    flip_a_bit(a.tier.engine.roots[0].layout.block_path(keys[1]))

    b = start(replicas, ours(disk_root, enable_kv_events=True), enable_kv_events=True)

    def vanish(key):  # found by the lookup, gone before the load runs (gc): announced too
        if key == keys[2]:
            os.unlink(b.tier.engine.roots[0].layout.block_path(key))

    # Two requests, two load jobs: a job stops at its first failed block.
    final = resolve(b, [keys[0], keys[3], keys[1]])
    final.update(resolve(b, [keys[2]], vanish))
    assert final == {keys[0]: HIT, keys[1]: MISS, keys[2]: MISS, keys[3]: HIT}
    assert b.tier.engine.counters[Tally.QUARANTINED] == 1
    assert b.tier.engine.counters[Direction.LOAD, Failure.MISSING] == 1
    events = manager_storage_events(b)
    quarantined, gone = [e for e in events if e.removed]
    assert quarantined.keys == [keys[1]] and quarantined.medium is Medium.STORAGE
    assert gone.keys == [keys[2]] and gone.medium is Medium.STORAGE  # tests/tier/test_removals.py
    assert keys_of(events, removed=False) == set()  # loads announce nothing else
    # The writer's tier did not load anything: no removal from A.
    assert tier_events(a) == []


def _store_and_corrupt_load(root, replicas, tier_events_on, global_events_on):
    a = start(
        replicas, ours(root, enable_kv_events=tier_events_on), enable_kv_events=global_events_on
    )
    keys = make_keys(3, seed=f"events-off-{tier_events_on}-{global_events_on}")
    a.store(keys)
    flip_a_bit(a.tier.engine.roots[0].layout.block_path(keys[0]))
    b = start(
        replicas, ours(root, enable_kv_events=tier_events_on), enable_kv_events=global_events_on
    )
    final = resolve(b, keys)
    assert final[keys[0]] is MISS and b.tier.engine.counters[Tally.QUARANTINED] == 1
    return a, b


def test_no_events_when_the_tier_disables_them(disk_root, replicas):
    a, b = _store_and_corrupt_load(disk_root, replicas, tier_events_on=False, global_events_on=True)
    for replica in (a, b):
        assert tier_events(replica) == []
        assert manager_storage_events(replica) == []


def test_no_events_when_kv_cache_events_are_off_globally(disk_root, replicas):
    a, b = _store_and_corrupt_load(disk_root, replicas, tier_events_on=True, global_events_on=False)
    for replica in (a, b):
        assert tier_events(replica) == []
        assert manager_storage_events(replica) == []
