"""The tier announces removals it learns of: a block it stored or found that
a later lookup misses (a sweeper or gc removed it) or a load finds gone
yields one BlockRemoved through vLLM's take_events path -- once, however
many steps the prompt keeps asking, and at most once per key per window."""

from __future__ import annotations

import os

import pytest
from vllm.v1.kv_offload.base import LookupResult, Medium

from llmkv_fs.tier.removals import RemovalWatch
from tests.kits.clock_kit import ManualClock
from tests.kits.tier_kit import MiB, make_keys, ours, resolve, start

HIT, MISS = LookupResult.HIT, LookupResult.MISS


def removed_keys(replica) -> list[bytes]:
    with replica.manager.lock:
        events = list(replica.manager.take_events())
    return [k for e in events if e.removed and e.medium is Medium.STORAGE for k in e.keys]


@pytest.mark.usefixtures("io_mode")
def test_a_lookup_that_misses_a_stored_block_announces_it_once(disk_root, replicas):
    # A CPU tier of 4 chunks: storing 9 more pushes keys[1] out of it, so
    # its lookups reach our tier.
    a = start(
        replicas, ours(disk_root, enable_kv_events=True), enable_kv_events=True, cpu_bytes=8 * MiB
    )
    keys = make_keys(11, seed="removal-lookup")
    a.store(keys[:2])
    for i in range(2, 11, 3):
        a.store(keys[i : i + 3])
    assert removed_keys(a) == []
    os.unlink(a.tier.engine.roots[0].layout.block_path(keys[1]))  # a sweeper

    ctx = a.new_request()
    final, _ = a.find([keys[1]], ctx)
    assert final == {keys[1]: MISS}
    for _ in range(5):  # the scheduler asks again at every step
        with a.manager.lock:
            a.manager.lookup(keys[1], ctx)
    a.finish_request(ctx)
    assert removed_keys(a) == [keys[1]]
    assert resolve(a, [keys[1]]) == {keys[1]: MISS}
    assert removed_keys(a) == []  # once


@pytest.mark.usefixtures("io_mode")
def test_a_load_that_finds_a_block_gone_announces_it(disk_root, replicas):
    a = start(replicas, ours(disk_root, enable_kv_events=True), enable_kv_events=True)
    keys = make_keys(2, seed="removal-load")
    a.store(keys)
    b = start(replicas, ours(disk_root, enable_kv_events=True), enable_kv_events=True)

    def vanish(key):  # found by the lookup, gone before the load runs (gc)
        if key == keys[1]:
            os.unlink(b.tier.engine.roots[0].layout.block_path(key))

    assert resolve(b, keys, vanish) == {keys[0]: HIT, keys[1]: MISS}
    assert removed_keys(b) == [keys[1]]
    assert removed_keys(a) == []


def test_a_key_is_announced_at_most_once_per_window():
    clock = ManualClock()
    watch = RemovalWatch(capacity=2, window_s=60.0, clock=clock)
    k1, k2, k3 = b"k1", b"k2", b"k3"
    watch.present([k1, k2])
    watch.looked_up(k1, False)
    watch.looked_up(k1, False)
    assert watch.take() == [k1]
    watch.present([k1])  # stored again, gone again within the window: not again
    watch.gone([k1])
    assert watch.take() == []
    clock.advance(61.0)
    watch.gone([k1])
    assert watch.take() == [k1]
    watch.present([k2, k3, k1])  # capacity 2: the oldest known key is forgotten
    watch.looked_up(k2, False)
    assert watch.take() == []
    watch.announced([k3])  # a quarantine announced it already
    watch.looked_up(k3, False)
    assert watch.take() == []
