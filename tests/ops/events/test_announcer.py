"""gc announces every block file it removes, in vLLM's wire format: after
replicas store, a load quarantines, gc evicts, gc removes an orphaned
digest, ``verify --repair`` moves a file aside and a restarted router takes
a snapshot, a real ZMQ subscriber's index equals the blocks on the volume
(two roots, both io modes). A router that drops removals ends up wrong:
the test can fail."""

from __future__ import annotations

import json
import os

import pytest

from llmkv_fs.ops.events.announcer import Announcer
from llmkv_fs.ops.events.config import parse_events_config
from llmkv_fs.ops.events.options import EXIT_UNDELIVERED
from llmkv_fs.ops.events.snapshot import snapshot
from llmkv_fs.ops.verify import verify_volume
from tests.kits import gc_kit
from tests.kits.engine_kit import inside
from tests.kits.events_kit import (
    Router,
    connect_announcer,
    gc_announcing,
    pump,
    read_announcer,
    replica_publisher,
    volume_hashes,
)
from tests.kits.tier_kit import make_keys, ours, resolve, start
from tests.kits.volume_kit import flip_a_bit

DAY = 86400.0


def _file_of(replica, key: bytes) -> str:
    (path,) = [
        r.layout.block_path(key)
        for r in replica.tier.engine.roots
        if os.path.exists(r.layout.block_path(key))
    ]
    return path


@pytest.fixture
def two_roots(shared_volume):
    """Two roots as the replicas' client sees them, and the same two as
    another client sees them (GlusterFS: a second mount; elsewhere the same
    paths), where gc, verify and the snapshot run, as on another node."""
    names = ("r1", "r2")
    replicas_side = [os.path.join(shared_volume.a, name) for name in names]
    for root in replicas_side:
        os.mkdir(root)
    return replicas_side, [os.path.join(shared_volume.b, name) for name in names]


@pytest.mark.usefixtures("io_mode")
@pytest.mark.parametrize("drop_removals", [False, True], ids=["router", "router-dropping-removals"])
def test_router_index_equals_the_volume(two_roots, replicas, drop_removals):
    two_roots, gc_side = two_roots
    router = Router(drop_removals=drop_removals)
    tier = ours(",".join(two_roots), path_sharding="by_block_hash", enable_kv_events=True)
    a = start(replicas, tier, enable_kv_events=True)
    a_pub = replica_publisher(router, "a")
    announce = Announcer([parse_events_config(json.dumps({"endpoint": router.endpoint}))])
    connect_announcer(router, announce)
    mismatches = []

    def check(step: str) -> None:
        if router.index != volume_hashes(*gc_side):
            mismatches.append(step)

    try:
        # Six keys homed on each root: placement follows the roots' (random)
        # paths, and a root left with one block lost it to verify --repair
        # below, leaving the snapshot nothing to send (1 run in ~20).
        candidates = make_keys(200, seed="events-gc")
        home = inside(a.tier.engine).placement.home
        keys = [k for k in candidates if home(k) == 0][:6] + [
            k for k in candidates if home(k) == 1
        ][:6]
        a.store(keys)
        pump(a, a_pub, router)
        check("store")
        assert len(router.index) == 12

        # Another replica loads a damaged file: it quarantines and announces it.
        flip_a_bit(_file_of(a, keys[0]))
        b = start(replicas, tier, enable_kv_events=True)
        b_pub = replica_publisher(router, "b")
        assert resolve(b, [keys[0]])
        pump(b, b_pub, router)
        check("quarantine")

        # gc evicts everything on the first root (over its limit), announcing first.
        report = gc_announcing(gc_side[0], announce, max_bytes=0)
        assert report.capacity["evicted_blocks"] > 0 and report.events["published"] > 0
        read_announcer(router, announce)
        check("evict")
        assert volume_hashes(gc_side[1])  # the other root kept its blocks

        # An orphaned digest (no lease, idle for weeks) on the second root, known
        # to the router through a snapshot, then removed by gc.
        orphan = gc_kit.make_digest(gc_side[1], model="acme/old", config_age=30 * DAY)[0]
        for i in range(3):
            gc_kit.put_block(orphan, gc_kit.key(i, "orphan"), seconds_old=30 * DAY)
        snapshot(gc_side, announce)
        read_announcer(router, announce)
        check("snapshot")
        report = gc_announcing(gc_side[1], announce, min_age=DAY)
        assert [d["name"] for d in report.digests if d["removed"]] == [
            os.path.basename(orphan.base_path)
        ]
        read_announcer(router, announce)
        check("orphan")

        # verify --repair moves a damaged file aside: announced before the move.
        survivor = next(
            k
            for k in keys[1:]
            if any(os.path.exists(r.layout.block_path(k)) for r in a.tier.engine.roots)
        )
        flip_a_bit(_file_of(a, survivor))
        verify_volume(gc_side[1], repair=True, announce=announce)
        read_announcer(router, announce)
        check("verify --repair")
        moved = a.tier.engine.roots[1].layout.block_path(survivor)
        assert not os.path.exists(gc_side[1] + moved[len(two_roots[1]) :])

        # A restarted router learns the volume from a snapshot alone.
        fresh = Router(drop_removals=drop_removals)
        again = Announcer([parse_events_config(json.dumps({"endpoint": fresh.endpoint}))])
        connect_announcer(fresh, again)
        summary = snapshot(gc_side, again, rate=1e6)
        read_announcer(fresh, again)
        again.close()
        fresh.close()
        assert fresh.index == volume_hashes(*gc_side)
        assert summary["blocks"] == len(fresh.index) > 0
    finally:
        announce.close()
        router.close()
    if drop_removals:
        assert mismatches, "a router that drops BlockRemoved must disagree with the volume"
    else:
        assert mismatches == []


DEAD = {"endpoint": "tcp://127.0.0.1:9"}  # connect to a port nobody listens on


def test_a_dead_endpoint_and_a_full_queue_cost_events_never_the_pass(disk_root, capsys):
    layout = gc_kit.make_digest(disk_root)[0]
    paths = [gc_kit.put_block(layout, gc_kit.key(i, "dead"), seconds_old=DAY) for i in range(50)]
    config = json.dumps({**DEAD, "hwm": 1, "max_queue_size": 1, "wait_s": 0.2})
    status, report = gc_kit.gc(
        disk_root,
        "--max-bytes",
        "0",
        "--protect",
        "0s",
        "--kv-events-config",
        config,
        capsys=capsys,
    )
    # A one-pass gc waited wait_s for a subscriber, did its work, and says
    # its events were not delivered.
    assert status == EXIT_UNDELIVERED
    assert report["capacity"]["evicted_blocks"] == 50
    assert not any(os.path.exists(p) for p in paths)
    assert report["events"]["undelivered"] == 50


def test_a_watching_gc_with_a_dead_endpoint_keeps_its_memory_flat(disk_root):
    import tracemalloc

    import psutil

    layout = gc_kit.make_digest(disk_root)[0]
    announce = Announcer([parse_events_config(json.dumps(DEAD))])
    process = psutil.Process()
    tracemalloc.start()
    try:
        for i in range(1000):
            gc_kit.put_block(layout, gc_kit.key(i, "watch"), seconds_old=DAY)
            report = gc_announcing(disk_root, announce, max_bytes=0)
            assert report.capacity["evicted_blocks"] == 1
            if i == 199:
                traced, rss = tracemalloc.get_traced_memory()[0], process.memory_info().rss
        traced_growth = tracemalloc.get_traced_memory()[0] - traced
        rss_growth = process.memory_info().rss - rss
    finally:
        tracemalloc.stop()
        announce.close()
    assert announce.counts["published"] + announce.counts["dropped"] == 1000
    assert traced_growth < 256 * 1024, traced_growth
    assert rss_growth < 8 * 1024 * 1024, rss_growth


class _AnotherGcRemoves(Announcer):
    """An Announcer during whose publication of a batch of removals another
    gc (or a person) unlinks ``vanish`` of its blocks: gc's own unlinks of
    those then meet ENOENT."""

    def __init__(self, targets, layout, vanish: int):
        super().__init__(targets)
        self.layout, self.vanish, self.announced = layout, vanish, []

    def removed(self, key: bytes) -> None:
        super().removed(key)
        self.announced.append(key)

    def flush(self) -> int:
        n = super().flush()
        while self.announced and self.vanish:
            os.unlink(self.layout.block_path(self.announced.pop(0)))
            self.vanish -= 1
        return n


def test_a_block_gone_before_its_unlink_stays_announced_removed(disk_root):
    layout = gc_kit.make_digest(disk_root)[0]
    for i in range(6):
        gc_kit.put_block(layout, gc_kit.key(i, "vanish"), seconds_old=DAY)
    router = Router()
    announce = _AnotherGcRemoves(
        [parse_events_config(json.dumps({"endpoint": router.endpoint}))], layout, vanish=2
    )
    try:
        connect_announcer(router, announce)
        snapshot([disk_root], announce)
        read_announcer(router, announce)
        assert len(router.index) == 6
        report = gc_announcing(disk_root, announce, max_bytes=0)
        read_announcer(router, announce)
    finally:
        announce.close()
        router.close()
    assert announce.vanish == 0 and report.capacity["evicted_blocks"] == 4
    assert volume_hashes(disk_root) == set()
    assert router.index == set()  # never announced stored again
