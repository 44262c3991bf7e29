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
from tests.kits.engine_kit import inside
from tests.kits.tier_kit import MiB, make_keys, ours, resolve, start, wait_until
from tests.kits.volume_kit import BindVolume

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
    wait_until(
        lambda: a.step() or not inside(a.tier.engine).recheck_stalled(), "the volume to answer"
    )
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
    assert inside(a.tier.engine).recheck_stalled()  # and the volume is stalled: refused after
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
    wait_until(lambda: a.step() or inside(engine).recheck_stalled(), "the deadline to pass")

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


def test_a_key_is_announced_once_per_window_unless_found_again():
    clock = ManualClock()
    watch = RemovalWatch(capacity=2, window_s=60.0, clock=clock)
    k1, k2, k3 = b"k1", b"k2", b"k3"
    watch.present([k1, k2])
    watch.looked_up(k1, False)
    watch.looked_up(k1, False)
    assert watch.take() == [k1]
    watch.gone([k1])  # a load finds it gone again within the window: not again
    assert watch.take() == []
    watch.present([k1], stored=True)  # stored again (the store announces it)
    assert watch.take_back() == []
    watch.gone([k1])  # and removed again within the window: announced again
    assert watch.take() == [k1]
    watch.looked_up(k1, True)  # found by a lookup: announced stored again
    assert watch.take_back() == [k1]
    watch.looked_up(k1, True)
    assert watch.take_back() == []  # once
    watch.gone([k1])
    assert watch.take() == [k1]
    clock.advance(61.0)
    watch.gone([k1])
    assert watch.take() == [k1]
    watch.present([k2, k3, k1])  # capacity 2: the oldest known key is forgotten
    watch.looked_up(k2, False)
    assert watch.take() == []
    watch.announced([k3])  # a quarantine announced it already
    watch.looked_up(k3, False)
    assert watch.take() == []


def stored_keys(replica) -> list[bytes]:
    with replica.manager.lock:
        events = list(replica.manager.take_events())
    return [k for e in events if not e.removed and e.medium is Medium.STORAGE for k in e.keys]


class _RenamedAway:
    """The root's parent renamed away and an empty directory put in its place."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.root = str(tmp_path / "vol" / "kv")
        os.makedirs(self.root)

    def lose(self) -> None:
        os.rename(self.tmp_path / "vol", self.tmp_path / "away")
        (self.tmp_path / "vol" / "kv").mkdir(parents=True)

    def bring_back(self) -> None:
        os.rename(self.tmp_path / "vol", self.tmp_path / "empty")
        os.rename(self.tmp_path / "away", self.tmp_path / "vol")

    def close(self) -> None:
        pass


class _Unmounted(BindVolume):
    """The volume (a tmpfs bound at the mount point) unmounted and mounted
    again: the very same directory back."""

    def __init__(self, tmp_path):
        super().__init__(tmp_path)
        self.root = self.mountpoint
        self.lose, self.bring_back = self.unmount, self.mount


@pytest.mark.parametrize("how", [_RenamedAway, _Unmounted], ids=["renamed", "unmounted"])
@pytest.mark.usefixtures("io_mode")
def test_a_root_lost_for_a_while_announces_nothing_removed(tmp_path, replicas, how):
    """The root lost for a while: its keys miss while it is lost (nobody
    looked at their files), and hit again once it is back -- with no removal
    announced at any point."""
    volume = how(tmp_path)
    try:
        _lost_and_back(replicas, volume)
    finally:
        for replica in reversed(replicas):
            replica.close()
        replicas.clear()
        volume.close()


def _lost_and_back(replicas, volume) -> None:
    a, key = stored_then_pushed_out(replicas, volume.root, "removal-lost-root")
    engine = a.tier.engine
    volume.lose()
    wait_until(lambda: a.step() or engine.roots[0].lost, "the root to be lost")
    assert resolve(a, [key]) == {key: MISS}
    assert removed_keys(a) == []

    volume.bring_back()
    wait_until(lambda: a.step() or not engine.roots[0].lost, "the root to be back")
    assert resolve(a, [key]) == {key: HIT}
    assert removed_keys(a) == []
    assert os.path.exists(engine.roots[0].layout.block_path(key))  # index == volume


@pytest.mark.usefixtures("io_mode")
def test_a_block_announced_removed_and_found_again_is_announced_stored(disk_root, replicas):
    a, key = stored_then_pushed_out(replicas, disk_root, "removal-back")
    path = a.tier.engine.roots[0].layout.block_path(key)
    with open(path, "rb") as f:
        kept = f.read()
    os.unlink(path)  # a sweeper
    assert resolve(a, [key]) == {key: MISS}
    assert removed_keys(a) == [key]

    with open(path, "wb") as f:  # another replica stores it again
        f.write(kept)
    assert resolve(a, [key]) == {key: HIT}
    assert stored_keys(a) == [key]  # the removal is taken back
    assert resolve(a, [key]) == {key: HIT}
    assert stored_keys(a) == []  # once


@pytest.mark.integration
@pytest.mark.usefixtures("io_mode")
def test_lookups_that_meet_eio_announce_nothing_removed(tmp_path, replicas):
    """A volume answering EIO (an ext4 shut down, EXT4_IOC_SHUTDOWN): its
    lookups miss, and none of them is taken for a removal."""
    from tests.kits.matrix_kit import ext4_shutdown, loop_ext4

    with loop_ext4(tmp_path / "eio") as root:
        a = start(
            replicas,
            ours(root, enable_kv_events=True),
            enable_kv_events=True,
            cpu_bytes=8 * MiB,
        )
        keys = make_keys(11, seed="removal-eio")
        a.store(keys[:2])
        for i in range(2, 11, 3):
            a.store(keys[i : i + 3])
        assert removed_keys(a) == []
        ext4_shutdown(root)
        assert resolve(a, keys[:2]) == {keys[0]: MISS, keys[1]: MISS}
        assert removed_keys(a) == []
        # Removing the lease would meet EIO at shutdown (its own test elsewhere).
        a.tier.engine.roots[0].housekeeping.lease_path = None
        replicas.remove(a)
        a.close()
