"""The space guard on real, small tmpfs volumes: the watermark, min_free_bytes
and ENOSPC trip it, loads go on while it is tripped, and freeing space (what
gc does) lifts it. Plus the VolumeUsage/SpaceGuard arithmetic against real
statvfs numbers.

The housekeeping thread samples the volume about once a second; tests wait
for a sample by polling (the guard's ``usage`` object is replaced by every
sample), never by sleeping.
"""

from __future__ import annotations

import os
import shutil

import pytest

from llmkv_fs.cli import main as cli_main
from llmkv_fs.config import TierSettings
from llmkv_fs.engine import Direction, Failure, Outcome
from llmkv_fs.engine.upkeep import space
from llmkv_fs.engine.upkeep.space import SpaceGuard, trip_on_enospc
from llmkv_fs.layout.blockfile import TRAILER_SIZE
from llmkv_fs.volume.fsinfo import VolumeUsage, volume_usage
from tests.kits.engine_kit import (
    BS,
    fill,
    inside,
    make_key,
    pattern,
    row,
    store_blocks,
    wait_jobs,
    wait_until,
)
from tests.kits.volume_kit import block_files, temp_files, write_filler

MiB = 1 << 20


@pytest.fixture
def small_tmpfs(mount_tmpfs):
    """A real 16 MiB tmpfs of our own (nobody else writes to it)."""
    return mount_tmpfs("16m")


# Blocks a place takes one at a time (engine/launch.py slices at most 4 MiB),
# so the headroom is one block per place the executor has, plus one.
BIG = 4 * MiB


@pytest.fixture
def tmpfs_of_15_big_blocks(mount_tmpfs):
    """A real 64 MiB tmpfs of our own: 15 files of BIG blocks fit."""
    return mount_tmpfs("64m")


def wait_samples(engine, n: int = 1) -> None:
    """Wait until the housekeeping thread has sampled the volume n more times."""
    for _ in range(n):
        seen = engine.roots[0].guard.usage
        wait_until(lambda seen=seen: engine.roots[0].guard.usage is not seen, "a space sample")


def tripped(engine) -> bool:
    return root_gauges(engine)["space_guard_tripped"] == 1


def root_gauges(engine) -> dict[str, float]:
    return engine.root_gauges()[engine.roots[0].layout.root_dir]


# -- the arithmetic, with real statvfs ------------------------------------------------------


def test_volume_usage_matches_statvfs_and_df(small_tmpfs):
    usage = volume_usage(small_tmpfs)
    disk = shutil.disk_usage(small_tmpfs)
    assert (usage.total_bytes, usage.used_bytes, usage.free_bytes) == (
        disk.total,
        disk.used,
        disk.free,
    )
    assert usage.total_bytes == 16 * MiB

    write_filler(f"{small_tmpfs}/four", 4 * MiB)
    after = volume_usage(small_tmpfs)
    assert after.used_bytes - usage.used_bytes == 4 * MiB  # tmpfs counts whole pages
    assert usage.free_bytes - after.free_bytes == 4 * MiB
    assert after.used_percent == pytest.approx(
        100.0 * after.used_bytes / (after.used_bytes + after.free_bytes)
    )
    assert 24.9 < after.used_percent < 26.0


def test_used_percent_excludes_the_root_reserve():
    # 1000 bytes in total, 500 reserved for root: half of the usable space is used.
    assert VolumeUsage(1000, 250, 250).used_percent == 50.0
    assert VolumeUsage(1000, 0, 1000).used_percent == 0.0
    assert VolumeUsage(0, 0, 0).used_percent == 100.0  # no usable space at all


def test_guard_trips_on_watermark_and_min_free(small_tmpfs):
    write_filler(f"{small_tmpfs}/half", 8 * MiB)
    now = volume_usage(small_tmpfs)
    assert 49.0 < now.used_percent < 51.0

    over = SpaceGuard(small_tmpfs, now.used_percent - 1, 0, headroom_bytes=MiB)
    assert over.sample() == now
    assert not over.allows_store() and over.reason == "watermark"
    under = SpaceGuard(small_tmpfs, now.used_percent + 1, 0, headroom_bytes=MiB)
    under.sample()
    assert under.allows_store() and under.reason == "ok"

    short = SpaceGuard(small_tmpfs, 100.0, now.free_bytes + 1, headroom_bytes=MiB)
    short.sample()
    assert not short.allows_store() and short.reason == "watermark"
    enough = SpaceGuard(small_tmpfs, 100.0, now.free_bytes, headroom_bytes=MiB)
    enough.sample()
    assert enough.allows_store()

    # The mark is not sticky: freeing space lifts it at the next sample.
    os.unlink(f"{small_tmpfs}/half")
    over.sample()
    assert over.allows_store()


def test_enospc_holds_until_free_space_grows_by_the_headroom(small_tmpfs):
    guard = SpaceGuard(small_tmpfs, 100.0, 0, headroom_bytes=MiB)
    guard.sample()
    assert guard.allows_store()
    write_filler(f"{small_tmpfs}/a", MiB // 2)
    write_filler(f"{small_tmpfs}/b", MiB // 2)
    write_filler(f"{small_tmpfs}/c", MiB // 2)
    write_filler(f"{small_tmpfs}/rest", volume_usage(small_tmpfs).free_bytes)  # full

    trip_on_enospc(guard.signals, guard.path)  # the baseline: what is free at the failure
    assert not guard.allows_store() and guard.reason == "ENOSPC"
    guard.sample()
    assert not guard.allows_store()
    guard.sample()
    assert not guard.allows_store()  # no room was made
    os.unlink(f"{small_tmpfs}/a")  # half the headroom
    guard.sample()
    assert not guard.allows_store() and guard.reason == "ENOSPC"
    os.unlink(f"{small_tmpfs}/b")  # exactly the headroom
    guard.sample()
    assert guard.allows_store() and guard.reason == "ok"

    # A new ENOSPC measures from the new baseline.
    trip_on_enospc(guard.signals, guard.path)
    guard.sample()
    os.unlink(f"{small_tmpfs}/c")
    guard.sample()
    assert not guard.allows_store()


def test_room_made_right_after_enospc_lifts_the_guard(small_tmpfs):
    """gc (or anyone) frees space within the sample interval of an ENOSPC:
    the baseline is what was free at the failure, so the freed room counts.
    (Measured at the next sample, after the freeing, it would demand that
    much again, and with nothing left to free the guard stayed tripped.)"""
    guard = SpaceGuard(small_tmpfs, 100.0, 0, headroom_bytes=MiB)
    guard.sample()
    free = volume_usage(small_tmpfs).free_bytes
    write_filler(f"{small_tmpfs}/fill", free)  # the volume is full now
    with pytest.raises(OSError):  # a real ENOSPC
        write_filler(f"{small_tmpfs}/more", MiB)
    trip_on_enospc(guard.signals, guard.path)  # as the I/O thread that got it does
    os.unlink(f"{small_tmpfs}/fill")  # room made before the next sample
    guard.sample()
    assert guard.allows_store() and guard.reason == "ok"


def test_a_volume_with_less_than_ten_headrooms_in_use_lifts_at_a_tenth(small_tmpfs):
    """The headroom (every block the executor can hold) can be more than gc
    frees of a small volume: a tenth of the bytes in use at the failure is
    then enough -- the guard would otherwise refuse stores for good."""
    guard = SpaceGuard(small_tmpfs, 100.0, 0, headroom_bytes=64 * MiB)  # 4x the volume
    guard.sample()
    write_filler(f"{small_tmpfs}/a", MiB)
    write_filler(f"{small_tmpfs}/b", MiB)
    write_filler(f"{small_tmpfs}/rest", volume_usage(small_tmpfs).free_bytes)
    with pytest.raises(OSError):  # a real ENOSPC: the volume is full
        write_filler(f"{small_tmpfs}/more", MiB)
    trip_on_enospc(guard.signals, guard.path)
    baseline = guard.signals.free_at_enospc()
    usage = guard.sample()
    needed = guard.room_needed(baseline, usage)
    assert needed == (usage.usable_bytes - baseline) // 10  # 1.6 MiB
    assert MiB < needed < 2 * MiB and not guard.allows_store()

    os.unlink(f"{small_tmpfs}/a")
    guard.sample()
    assert not guard.allows_store() and guard.reason == "ENOSPC"
    os.unlink(f"{small_tmpfs}/b")
    guard.sample()
    assert guard.allows_store() and guard.reason == "ok"


def test_room_needed_is_the_headroom_a_tenth_in_use_or_one_byte(small_tmpfs):
    guard = SpaceGuard(small_tmpfs, 100.0, 0, headroom_bytes=MiB)
    usage = guard.sample()
    assert guard.room_needed(0, usage) == MiB  # a tenth of 16 MiB in use is more
    assert guard.room_needed(usage.usable_bytes - MiB, usage) == MiB // 10
    # A volume whose numbers say nothing is in use: one byte must still come free,
    # or every sample would lift the guard for stores that meet ENOSPC again.
    assert guard.room_needed(usage.usable_bytes, usage) == 1


def test_enospc_baseline_falls_back_to_the_next_sample(small_tmpfs, monkeypatch):
    guard = SpaceGuard(small_tmpfs, 100.0, 0, headroom_bytes=MiB)

    def unreadable(path):
        raise OSError(5, "statvfs failed")

    real = space.volume_usage
    monkeypatch.setattr(space, "volume_usage", unreadable)
    trip_on_enospc(guard.signals, guard.path)  # could not measure: the next sample is the baseline
    monkeypatch.setattr(space, "volume_usage", real)
    guard.sample()
    assert not guard.allows_store()


# -- through the engine ---------------------------------------------------------------------


def _stored_until_enospc(engines, volume: str, n_keys: int):
    """An engine on ``volume`` (BIG blocks, two rows, no watermark) whose
    first store job, ``n_keys`` blocks, met ENOSPC: (engine, layout)."""
    engine, layout, primary = engines(
        volume,
        n_blocks=2,
        block_size=BIG,
        n_read_threads=1,
        n_write_threads=1,
        max_usage_percent=100,
    )
    for c in range(2):
        fill(primary, c, pattern(c, BIG), BIG)
    keys = [make_key(f"full{i}") for i in range(n_keys)]
    assert engine.submit_store(1, keys, [i % 2 for i in range(n_keys)])
    assert not wait_jobs(engine, [1])[1].success
    assert engine.roots[0].guard.reason == "ENOSPC"
    return engine, layout


def test_engine_resumes_stores_when_room_is_made_right_after_enospc(
    tmpfs_of_15_big_blocks, engines
):
    volume = tmpfs_of_15_big_blocks
    engine, _layout = _stored_until_enospc(engines, volume, 24)
    for path in block_files(volume):  # gc empties the volume at once
        os.unlink(path)
    wait_until(lambda: not tripped(engine), "the guard to lift")
    assert engine.submit_store(2, [make_key("after")], [0])
    assert wait_jobs(engine, [2])[2].success


def test_engine_resumes_after_one_gc_pass_with_its_default_band(tmpfs_of_15_big_blocks, engines):
    """The tier fills its 64 MiB volume with BIG blocks until ENOSPC; one
    gc pass with its default watermarks (85 -> 75 %) frees down to 75 %,
    less than the headroom with worker processes (5 blocks): stores resume,
    as they did not when the guard waited for the whole headroom."""
    volume, bs = tmpfs_of_15_big_blocks, BIG
    engine, layout = _stored_until_enospc(engines, volume, 24)
    guard = engine.roots[0].guard
    assert guard.headroom_bytes >= 3 * bs
    before = set(block_files(volume))
    wait_samples(engine, 2)  # the guard has its post-ENOSPC baseline
    assert cli_main(["gc", volume, "--protect", "0"]) == 0
    evicted = before - set(block_files(volume))
    assert 0 < len(evicted) < len(before)
    wait_until(lambda: not tripped(engine), "the guard to lift")
    assert engine.submit_store(2, [make_key("after")], [1])
    assert wait_jobs(engine, [2])[2].success
    with open(layout.block_path(make_key("after")), "rb") as f:
        assert f.read(bs) == pattern(1, bs)


def test_watermark_drops_stores_loads_continue_and_gc_lifts_it(small_tmpfs, engines):
    engine, layout, primary = engines(small_tmpfs, n_blocks=16, max_usage_percent=50)
    assert not tripped(engine)
    store_blocks(engine, primary, 1, range(4), range(4))

    write_filler(f"{small_tmpfs}/filler", 10 * MiB)  # another writer fills the volume
    wait_until(lambda: tripped(engine), "the guard to see the volume over 50%")
    gauges = root_gauges(engine)
    assert gauges["volume_used_bytes"] >= 10 * MiB
    assert gauges["volume_free_bytes"] < 6 * MiB
    assert engine.roots[0].guard.reason == "watermark"

    dropped = [make_key(i) for i in (10, 11, 12)]
    for chunk, i in zip((4, 5, 6), (10, 11, 12)):
        fill(primary, chunk, pattern(i))
    assert engine.submit_store(2, dropped, [4, 5, 6]) is False
    (job,) = engine.take_finished()  # reported at once: the next poll has it
    assert job.job_id == 2
    assert not job.success and job.failed == dropped
    assert engine.counters[Direction.STORE, Failure.SPACE] == 3
    assert not any(os.path.lexists(layout.block_path(k)) for k in dropped)

    # Loads of what is there go on, byte-exact.
    assert engine.submit_load(3, [make_key(i) for i in range(4)], [12, 13, 14, 15])
    loaded = wait_jobs(engine, [3])[3]
    assert loaded.success
    for i in range(4):
        assert row(primary, 12 + i) == pattern(i)

    os.unlink(f"{small_tmpfs}/filler")  # gc made room
    # Lifted by the guard's own sampling (housekeeping, about once a second),
    # with no store to try it: the wait is a hang bound, not a latency bound.
    wait_until(lambda: not tripped(engine), "the guard to lift")
    assert engine.submit_store(4, dropped, [4, 5, 6])
    assert wait_jobs(engine, [4])[4].success
    assert all(os.path.getsize(layout.block_path(k)) == BS + TRAILER_SIZE for k in dropped)
    assert engine.counters[Direction.STORE, Failure.SPACE] == 3


def test_queued_stores_are_dropped_when_the_guard_trips_under_them(small_tmpfs, engines, gate_for):
    engine, layout, primary = engines(
        small_tmpfs,
        n_blocks=8,
        n_read_threads=1,
        n_write_threads=1,
        max_usage_percent=50,
    )
    # Held with their temp file written, past the guard check; the blocks
    # after them are queued (threads) or next in a worker's pipe: not
    # started, so they still ask the guard.
    gate = gate_for(engine, kinds=("store",), point="publish")
    for c in range(5):
        fill(primary, c, pattern(c))
    running = [make_key(0), make_key(1)]
    queued = [make_key(c) for c in (2, 3, 4)]
    assert engine.submit_store(1, running, [0, 1])
    gate.wait_entered(2)  # both places are past the guard check, held
    assert engine.submit_store(2, queued, [2, 3, 4])  # accepted: not full yet
    write_filler(f"{small_tmpfs}/filler", 10 * MiB)
    wait_until(lambda: tripped(engine), "the guard to trip")
    gate.open()
    done = wait_jobs(engine, [1, 2])
    assert done[1].success  # a copy in flight is never cut short
    assert not done[2].success and sorted(done[2].failed) == sorted(queued)
    assert engine.counters[Direction.STORE, Failure.SPACE] == 3
    assert engine.counters[Direction.STORE, Failure.ERROR] == 0
    assert {k for _t, _kind, k in gate.entries} == set(running)  # queued ones never wrote
    assert sorted(block_files(small_tmpfs)) == sorted(layout.block_path(k) for k in running)
    assert temp_files(small_tmpfs) == []


def test_min_free_bytes_trips_at_start_and_lifts_when_space_is_freed(small_tmpfs, engines):
    write_filler(f"{small_tmpfs}/filler", 10 * MiB)
    settings = TierSettings.from_mapping(
        {"root_dir": small_tmpfs, "max_usage_percent": 100, "min_free_bytes": "8MiB"}
    )
    assert settings.min_free_bytes == 8 * MiB
    engine, layout, primary = engines(
        small_tmpfs,
        n_blocks=4,
        max_usage_percent=100,
        min_free_bytes=settings.min_free_bytes,
    )
    assert tripped(engine)  # the first sample is taken before any store
    assert root_gauges(engine)["volume_free_bytes"] < 8 * MiB
    fill(primary, 0, pattern("m"))
    assert engine.submit_store(1, [make_key("m")], [0]) is False
    (job,) = engine.take_finished()  # reported at once: the next poll has it
    assert job.job_id == 1 and not job.success
    assert engine.counters[Direction.STORE, Failure.SPACE] == 1

    os.unlink(f"{small_tmpfs}/filler")
    wait_until(lambda: not tripped(engine), "the guard to lift")
    store_blocks(engine, primary, 2, ["m"], [0])
    assert os.path.getsize(layout.block_path(make_key("m"))) == BS + TRAILER_SIZE


def test_enospc_trips_the_guard_until_gc_frees_the_room_needed(tmpfs_of_15_big_blocks, engines):
    volume, bs = tmpfs_of_15_big_blocks, BIG
    engine, layout, primary = engines(
        volume,
        n_blocks=4,
        block_size=bs,
        n_read_threads=1,
        n_write_threads=1,
        max_usage_percent=100,
    )
    headroom = engine.roots[0].guard.headroom_bytes
    # One block per place the executor has (both kinds store), plus one:
    # 2 threads, or 2 workers holding 2 blocks each.
    assert headroom == (inside(engine).executor.capacity() + 1) * bs
    assert headroom == (3 if not engines.mode.workers else 5) * bs
    for c in range(4):
        fill(primary, c, pattern(c, bs), bs)
    keys = [make_key(f"e{i}") for i in range(24)]
    assert engine.submit_store(1, keys, [i % 4 for i in range(24)])
    job = wait_jobs(engine, [1])[1]
    assert not job.success

    c = engine.counters
    files = block_files(volume)
    assert 0 < len(files) < 24
    assert c[Outcome.WRITTEN] == len(files) == len(job.succeeded)
    assert c[Direction.STORE, Failure.ERROR] >= 1  # the ENOSPC(s)
    assert c[Direction.STORE, Failure.ERROR] + c[Direction.STORE, Failure.SPACE] == 24 - len(files)
    assert c[Direction.STORE, Failure.SPACE] >= 1  # later blocks were not even tried
    assert {os.path.getsize(f) for f in files} == {bs + TRAILER_SIZE}  # nothing torn
    assert temp_files(volume) == []
    assert engine.roots[0].guard.reason == "ENOSPC" and tripped(engine)

    wait_samples(engine, 2)  # the guard has its post-ENOSPC baseline
    baseline = engine.roots[0].guard.usage.free_bytes
    assert engine.submit_store(2, [make_key("x")], [0]) is False

    # The room needed: a tenth of the ~60 MiB in use, less than the headroom here.
    guard = engine.roots[0].guard
    base = guard.signals.free_at_enospc()
    needed = guard.room_needed(base, guard.usage)
    assert bs < needed < 2 * bs <= headroom

    # gc frees a block at a time; after each, the guard's verdict is the rule's
    # (the baseline may already count a partial block another writer removed
    # after it was measured, so the step that lifts it is not fixed).
    refused = [2]
    for path in sorted(files):
        os.unlink(path)
        wait_samples(engine, 2)  # a whole sample after the unlink
        free = guard.usage.free_bytes
        assert tripped(engine) == (free < base + needed)
        if not tripped(engine):
            break
        refused.append(10 + len(refused))
        assert engine.submit_store(refused[-1], [make_key("x")], [0]) is False
    assert not tripped(engine) and free - base < headroom  # the headroom itself was not needed
    assert guard.usage.free_bytes >= baseline + bs
    assert engine.submit_store(4, [make_key("x")], [0])
    assert wait_jobs(engine, [*refused, 4])[4].success
    with open(layout.block_path(make_key("x")), "rb") as f:
        assert f.read(bs) == pattern(0, bs)
    assert c[Direction.STORE, Failure.SPACE] >= 1 + len(refused)
