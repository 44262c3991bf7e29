"""The tier announces removals it learns of: a block it stored or found that
a later lookup misses (a sweeper or gc removed it) or a load finds gone
yields one BlockRemoved through vLLM's take_events path -- once, however
many steps the prompt keeps asking, and at most once per key per window.
A MISS that did not look at the volume (refused while stalled, or answered
by the lookup deadline) announces nothing: the file may still be there."""

from __future__ import annotations

import os

import pytest
from vllm.v1.kv_offload.base import LookupResult, Medium

from llmkv_fs.tier.removals import RemovalWatch
from tests.kits.clock_kit import ManualClock
from tests.kits.tier_kit import MiB, make_keys, ours, resolve, start, wait_until

HIT, MISS = LookupResult.HIT, LookupResult.MISS


def removed_keys(replica) -> list[bytes]:
    with replica.manager.lock:
        events = list(replica.manager.take_events())
    return [k for e in events if e.removed and e.medium is Medium.STORAGE for k in e.keys]


def stored_then_pushed_out(replicas, root: str, seed: str, **settings):
    """A replica with events that stored a key which then left its CPU tier
    (4 chunks: 9 more stores push it out), so its lookups reach our tier."""
    a = start(
        replicas,
        ours(root, enable_kv_events=True, **settings),
        enable_kv_events=True,
        cpu_bytes=8 * MiB,
    )
    keys = make_keys(11, seed=seed)
    a.store(keys[:2])
    for i in range(2, 11, 3):
        a.store(keys[i : i + 3])
    assert removed_keys(a) == []
    return a, keys[1]


@pytest.mark.usefixtures("io_mode")
def test_a_lookup_that_misses_a_stored_block_announces_it_once(disk_root, replicas):
    a, key = stored_then_pushed_out(replicas, disk_root, "removal-lookup")
    os.unlink(a.tier.engine.roots[0].layout.block_path(key))  # a sweeper

    ctx = a.new_request()
    final, _ = a.find([key], ctx)
    assert final == {key: MISS}
    for _ in range(5):  # the scheduler asks again at every step
        with a.manager.lock:
            a.manager.lookup(key, ctx)
    a.finish_request(ctx)
    assert removed_keys(a) == [key]
    assert resolve(a, [key]) == {key: MISS}
    assert removed_keys(a) == []  # once


def gone_is_announced_once_the_volume_answers(a, key) -> None:
    """The volume answers again: the key is still known, and a real miss
    (a sweeper removed the file) is what announces it."""
    wait_until(lambda: a.step() or not a.tier.engine.recheck_stalled(), "the volume to answer")
    os.unlink(a.tier.engine.roots[0].layout.block_path(key))
    assert resolve(a, [key]) == {key: MISS}
    assert removed_keys(a) == [key]


@pytest.mark.usefixtures("io_mode")
def test_a_miss_answered_by_the_lookup_deadline_announces_nothing(
    disk_root, replicas, gate_on, engine_clock
):
    a, key = stored_then_pushed_out(replicas, disk_root, "removal-deadline", job_timeout_s=1.0)
    gate = gate_on(a.tier.engine, ("lookup",), point="exists")  # the check inside the volume
    ctx = a.new_request()

    def checking() -> bool:
        with a.manager.lock:
            a.manager.lookup(key, ctx)
        a.step()
        return bool(gate.entries)

    wait_until(checking, "the check to reach the volume")
    engine_clock.advance(1.0)  # the lookup deadline: min(job_timeout_s, 5 s)
    final, _ = a.find([key], ctx)
    assert final == {key: MISS}
    assert a.tier.engine.recheck_stalled()  # and the volume is stalled: refused after
    a.finish_request(ctx)
    assert resolve(a, [key]) == {key: MISS}
    assert removed_keys(a) == []  # the file is still there

    gate.open()
    gone_is_announced_once_the_volume_answers(a, key)


@pytest.mark.usefixtures("io_mode")
def test_a_stalled_volume_s_refusals_announce_nothing(disk_root, replicas, gate_on, engine_clock):
    a, key = stored_then_pushed_out(replicas, disk_root, "removal-stalled", job_timeout_s=1.0)
    engine = a.tier.engine
    gate = gate_on(engine, ("store",))
    a.store(make_keys(1, seed="removal-stalled-store"), settle=False)
    wait_until(lambda: engine.gauges()["held_blocks"] == 1, "the store held by the volume")
    engine_clock.advance(1.0)  # its deadline: a block inside the volume, stalled
    wait_until(lambda: a.step() or engine.recheck_stalled(), "the deadline to pass")

    assert resolve(a, [key]) == {key: MISS}  # refused: lookups never wait on a stall
    assert removed_keys(a) == []

    gate.open()
    a.settle()
    gone_is_announced_once_the_volume_answers(a, key)


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
