"""Per-job deadlines and the stalled volume: FsEngine without vLLM (a Gate
holds blocks at the engine's pause points -- in I/O threads or in worker
processes, see the io_mode fixture -- which is what a hung mount does), then
the same through vLLM's real TieringOffloadingManager.

Deadlines only fire when the owner polls (take_finished / end_step), and they
run on a clock the test moves (``engine_clock``: the engine's job and lookup
deadlines, tests/kits/clock_kit.py). So every test first waits until the blocks
are provably held, then moves the clock to just before the deadline --
nothing may fail yet -- and then to the deadline: the order of events never
depends on timing, and no test asserts on elapsed time.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from llmkv_fs.engine import Direction, Failure, LookupAnswer, MissReason, Outcome, Tally
from tests.kits.clock_kit import JUST_BEFORE_S, ManualClock
from tests.kits.engine_kit import (
    BS,
    DEADLINE_S,
    GATE_TIMEOUT_S,
    Gate,
    fill,
    held_by_executor,
    inside,
    make_key,
    pattern,
    replace_checks,
    row,
    settle,
    store_blocks,
    wait_jobs,
    wait_until,
)
from tests.kits.volume_kit import temp_files

TIMEOUT_S = 0.5


def up_to_the_deadline(engine, engine_clock: ManualClock, timeout_s: float = TIMEOUT_S) -> None:
    """Move ``engine_clock`` to just before the deadline of jobs submitted at its
    current reading: nothing is failed yet, however often the owner polls;
    then to the deadline itself."""
    engine_clock.advance(timeout_s - JUST_BEFORE_S)
    expired = engine.counters[Tally.DEADLINE_EXPIRED]
    assert engine.take_finished() == []
    engine.end_step()
    assert (
        engine.counters[Tally.DEADLINE_EXPIRED] == expired and not inside(engine).recheck_stalled()
    )
    engine_clock.advance(JUST_BEFORE_S)


def take_until(engine, predicate, what: str) -> list:
    """Poll take_finished until ``predicate(all results so far)``."""
    results = []
    deadline = time.monotonic() + DEADLINE_S
    while not predicate(results):
        results += engine.take_finished()
        if predicate(results):
            break
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; got {results}")
        time.sleep(0.002)
    return results


# -- stores ---------------------------------------------------------------------------------


def test_stuck_store_fails_at_deadline_and_is_never_published(
    volume, engines, gate_for, engine_clock
):
    disk_root = volume  # tmpfs, ext4 and GlusterFS
    # A block already on the volume (stored with the default 30 s deadline).
    seeder, _, seed_primary = engines(disk_root, n_blocks=2)
    store_blocks(seeder, seed_primary, 1, ["old"], [0])

    engine, layout, primary = engines(
        disk_root,
        n_blocks=16,
        n_read_threads=1,
        n_write_threads=1,
        job_timeout_s=TIMEOUT_S,
    )
    # Stores stop with their temp file written, right before the rename: a
    # write the volume has not finished as far as the owner can tell.
    gate = gate_for(engine, kinds=("store",), point="publish")
    for c in range(5):
        fill(primary, c, pattern(f"s{c}"))
    first = [make_key(f"s{c}") for c in range(3)]
    second = [make_key(f"s{c}") for c in (3, 4)]
    assert engine.submit_store(1, first, [0, 1, 2])
    gate.wait_entered(2)  # two places each wrote a block of job 1 and wait to publish it
    assert engine.submit_store(2, second, [3, 4])  # queued behind it, never started
    # Out of the queues: two threads' blocks, or with workers also the
    # blocks next in each worker's pipe (two each).
    out = min(5, inside(engine).executor.capacity())
    held_by_executor(engine, out)
    assert inside(engine).queued_store_blocks() == 5 - out
    assert not inside(engine).recheck_stalled()  # nobody is overdue yet
    held_temps = temp_files(disk_root)
    assert len(held_temps) == 2, held_temps

    up_to_the_deadline(engine, engine_clock)
    got = {
        j.job_id: j
        for j in take_until(
            engine, lambda rs: {r.job_id for r in rs} >= {1, 2}, "the deadline to fail both stores"
        )
    }
    assert not gate.opened.is_set()  # reported while its blocks are still held
    assert not got[1].success and sorted(got[1].failed) == sorted(first) and got[1].succeeded == []
    assert not got[2].success and sorted(got[2].failed) == sorted(second)
    assert got[1].nbytes == got[2].nbytes == 0
    c = engine.counters
    assert c[Tally.DEADLINE_EXPIRED] == 5  # the blocks out + the queued ones
    assert c[Direction.STORE, Failure.DEADLINE] == 5
    assert c[Outcome.WRITTEN] == 0
    assert engine.job_latencies[Direction.STORE] == [TIMEOUT_S, TIMEOUT_S]  # by the clock
    assert [kind for _t, kind, _k in gate.entries] == ["store", "store"]  # the others never ran
    assert inside(engine).queued_store_blocks() == 0

    # Stalled: the volume is not answering.
    assert inside(engine).recheck_stalled()
    assert engine.gauges()["stuck_blocks"] == out
    fill(primary, 5, pattern("late"))
    assert engine.submit_store(3, [make_key("late")], [5]) is False
    assert engine.submit_load(4, [make_key("old")], [6]) is False
    refused = {j.job_id: j for j in engine.take_finished()}  # at once, no I/O
    assert set(refused) == {3, 4}
    assert refused[3].failed == [make_key("late")] and not refused[3].is_load
    assert refused[4].failed == [make_key("old")] and refused[4].is_load
    assert c[Direction.STORE, Failure.STALLED] == 1 and c[Direction.LOAD, Failure.STALLED] == 1
    assert engine.lookup(make_key("old"), "r") is False  # exists, but the volume is stalled
    assert len(gate.entries) == 2
    assert row(primary, 6) == bytes(BS)

    # The volume answers again: the held writes go on but must not publish.
    gate.open()
    wait_until(lambda: not inside(engine).recheck_stalled(), "the stuck blocks to return")
    assert engine.gauges()["stuck_blocks"] == 0
    for tmp in held_temps:
        assert not os.path.lexists(tmp)  # the held blocks removed their temp files
    for key in first + second + [make_key("late")]:
        assert not os.path.lexists(layout.block_path(key)), "an expired store was published"
    assert temp_files(disk_root) == []
    assert len(gate.entries) == 2  # blocks waiting in a worker's pipe never started
    assert engine.take_finished() == []  # the abandoned blocks are not reported twice
    assert c[Outcome.WRITTEN] == 0 and c[Direction.STORE, Failure.ERROR] == 0

    # Threads recovered: a fresh round trip works byte-exact, and lookups
    # answered during the stall were not remembered.
    store_blocks(engine, primary, 10, ["fresh"], [7])
    assert engine.submit_load(11, [make_key("fresh"), make_key("old")], [8, 9])
    loaded = wait_jobs(engine, [11])[11]
    assert loaded.success
    assert row(primary, 8) == pattern("fresh") and row(primary, 9) == pattern("old")
    assert settle(engine, make_key("old"), "r2") is True


def test_a_slice_of_an_expired_store_runs_none_of_its_later_blocks(
    disk_root, engines, gate_for, engine_clock
):
    """A place takes several blocks of one job at once (a slice) when enough
    are queued. Once the job's deadline sets its cancel byte, the blocks of
    a slice behind the one held at its publish read that byte before they
    start: none of them writes a temp file or reaches the rename, and the
    held one is never published."""
    engine, layout, primary = engines(
        disk_root,
        n_blocks=16,
        n_read_threads=1,
        n_write_threads=1,
        job_timeout_s=TIMEOUT_S,
    )
    assert inside(engine).slice_blocks >= 4
    gate = gate_for(engine, kinds=("store",), point="publish")
    keys = [make_key(f"slice{c}") for c in range(16)]
    for c in range(16):
        fill(primary, c, pattern(f"slice{c}"))
    assert engine.submit_store(1, keys, list(range(16)))
    gate.wait_entered(2)  # the first block of two places' slices, written, not published
    # Threads: slices of 4 and 3 blocks; workers: 2 + 1 + 1 + 1 (two each).
    held_by_executor(engine, 5)
    held = engine.gauges()["held_blocks"]
    assert len(gate.entries) == 2 and held > 2  # blocks wait behind the held ones

    up_to_the_deadline(engine, engine_clock)
    job = wait_jobs(engine, [1])[1]
    assert not job.success and sorted(job.failed) == sorted(keys)
    assert engine.counters[Tally.DEADLINE_EXPIRED] == 16

    gate.open()
    wait_until(lambda: engine.gauges()["held_blocks"] == 0, "the held slices to come back")
    assert len(gate.entries) == 2  # no later block of a slice reached its rename
    for key in keys:
        assert not os.path.lexists(layout.block_path(key)), "an expired store was published"
    assert temp_files(disk_root) == []
    assert engine.counters[Outcome.WRITTEN] == 0
    assert engine.take_finished() == []  # reported once, at the deadline


def test_store_failed_by_deadline_reports_a_sane_io_time(
    disk_root, engines, gate_for, engine_clock
):
    engine, _, _primary = engines(
        disk_root,
        n_blocks=2,
        n_read_threads=1,
        n_write_threads=1,
        job_timeout_s=TIMEOUT_S,
    )
    gate = gate_for(engine)
    assert engine.submit_store(1, [make_key("t0"), make_key("t1")], [0, 1])
    held_by_executor(engine, 2)
    gate.wait_entered(1)
    up_to_the_deadline(engine, engine_clock)
    job = wait_jobs(engine, [1])[1]
    assert not gate.opened.is_set()
    assert not job.success
    # Not 0.0 - first_start (last_end was never set: no block finished).
    assert 0.0 <= job.io_seconds <= job.latency, job.io_seconds


def test_store_that_finishes_in_time_is_unaffected(disk_root, engines, engine_clock):
    engine, _layout, primary = engines(disk_root, n_blocks=4, job_timeout_s=5.0)
    store_blocks(engine, primary, 1, [0, 1, 2], [0, 1, 2])  # the clock stands still
    assert engine.counters[Outcome.WRITTEN] == 3
    engine_clock.advance(3600)  # its deadline long past: a finished job stays finished
    assert engine.take_finished() == []
    engine.end_step()
    assert engine.counters[Tally.DEADLINE_EXPIRED] == 0
    assert engine.counters[Direction.STORE, Failure.DEADLINE] == 0
    assert not inside(engine).recheck_stalled()


# -- loads ----------------------------------------------------------------------------------


def test_stuck_load_is_reported_only_when_its_reads_return(
    disk_root, engines, gate_for, engine_clock
):
    seeder, _, seed_primary = engines(disk_root, n_blocks=4)
    store_blocks(seeder, seed_primary, 1, range(4), range(4))

    engine, _, primary = engines(
        disk_root,
        n_blocks=8,
        n_read_threads=1,
        n_write_threads=1,
        job_timeout_s=TIMEOUT_S,
    )
    # Loads stop past their checks, right before the read: reads the volume
    # has not answered. Threads: blocks 0 and 1 in their reads, 2 and 3
    # queued. Workers: 0 and 1 in their reads, 2 and 3 next in the two
    # workers' pipes.
    gate = gate_for(engine, point="read")
    keys = [make_key(i) for i in range(4)]
    gate.hold(keys[0])
    gate.hold(keys[1])
    gate.open()
    out = min(4, inside(engine).executor.capacity())
    assert engine.submit_load(7, keys, [4, 5, 6, 7])
    held_by_executor(engine, out)
    gate.wait_entered(2)
    assert {k for _t, _kind, k in gate.entries} == set(keys[:2])

    # Past the deadline the queued blocks fail, but the job is held back:
    # the kernel may still write into rows 4 and 5.
    up_to_the_deadline(engine, engine_clock)
    early = []

    def overdue():
        early.extend(engine.take_finished())
        return inside(engine).recheck_stalled()

    wait_until(overdue, "the load to pass its deadline")
    assert early == []  # not reported while a read is in flight
    assert engine.counters[Tally.DEADLINE_EXPIRED] == 4 - out
    assert engine.gauges()["stuck_blocks"] == out
    assert engine.gauges()["queued_load_blocks"] == 0

    gate.release(keys[0])  # one read returns (with workers, the block behind it fails unread)
    left = 1 if out == 2 else 2
    wait_until(lambda: engine.gauges()["stuck_blocks"] == left, "the first read to return")
    assert inside(engine).recheck_stalled()
    assert engine.take_finished() == []  # still one read in flight
    assert row(primary, 4) == pattern(0)  # the real read did land

    gate.release(keys[1])
    job = wait_jobs(engine, [7])[7]
    assert not inside(engine).recheck_stalled()
    assert job.is_load and not job.success
    assert job.succeeded == keys[:2]  # completed reads keep their real result
    assert job.failed == keys[2:]
    assert job.latency == TIMEOUT_S  # reported at the deadline, by the clock
    assert row(primary, 4) == pattern(0) and row(primary, 5) == pattern(1)
    assert row(primary, 6) == bytes(BS) and row(primary, 7) == bytes(BS)  # never started
    assert engine.counters[Outcome.VERIFIED] == 2
    assert engine.counters[Direction.LOAD, Failure.DEADLINE] == 2
    assert {k for _t, kind, k in gate.entries if kind == "load"} == set(keys[:2])

    # Recovered: a failed-by-deadline block loads fine now.
    assert engine.submit_load(8, keys[2:], [6, 7])
    assert wait_jobs(engine, [8])[8].success
    assert row(primary, 6) == pattern(2) and row(primary, 7) == pattern(3)


# -- lookups --------------------------------------------------------------------------------


def test_overdue_lookups_miss_and_a_late_answer_keeps_the_failed_load_verdict(
    disk_root, engines, monkeypatch, engine_clock
):
    release, entered = threading.Event(), threading.Event()
    probed: list[bytes] = []

    def hung_exists(self, key):  # a metadata call the volume does not answer
        probed.append(key)
        entered.set()
        release.wait(GATE_TIMEOUT_S)
        return True  # the late answer: "it is there"

    replace_checks(monkeypatch, hung_exists)
    engine, _, _ = engines(disk_root, n_blocks=4, job_timeout_s=TIMEOUT_S)
    plain, doomed, newcomer = make_key("plain"), make_key("doomed"), make_key("new")
    try:
        assert engine.lookup(plain, "r1") is None
        assert engine.lookup(doomed, "r1") is None
        engine.end_step()
        assert entered.wait(DEADLINE_S)

        # A load of `doomed` fails (its file does not exist; or it is refused
        # because the volume already counts as stalled): its verdict is forced
        # to MISS while the existence check is still out.
        engine.submit_load(1, [doomed], [0])
        assert not wait_jobs(engine, [1])[1].success

        engine_clock.advance(TIMEOUT_S - JUST_BEFORE_S)  # the lookups' deadline: min(job's, 5 s)
        engine.end_step()
        assert (
            engine.counters[LookupAnswer.DEADLINE_MISS] == 0
            and not inside(engine).recheck_stalled()
        )
        assert engine.lookup(plain, "r1") is None  # still waiting for its check
        engine_clock.advance(JUST_BEFORE_S)
        engine.end_step()
        assert engine.counters[LookupAnswer.DEADLINE_MISS] == 2
        assert inside(engine).recheck_stalled()
        assert engine.lookup(plain, "r1") is False
        assert engine.lookup(doomed, "r1") is False
        assert engine.lookup(newcomer, "r2") is False  # answered at once while stalled
        # Each miss says why: refused while the volume is stalled.
        assert engine.counters[MissReason.STALLED] == 3 == engine.counters[LookupAnswer.MISS]
        assert probed == [plain]  # the batch is still held by its first check; no new one
        assert engine.counters[LookupAnswer.RETRY] == 3  # the first two, and plain's again
    finally:
        release.set()

    def answered():
        engine.end_step()
        return not inside(engine).recheck_stalled()

    wait_until(answered, "the late answer")
    # The late "found" must not turn the failed load's MISS into a HIT.
    assert engine.lookup(doomed, "r1") is False
    engine.end_step()
    assert engine.lookup(doomed, "r1") is False
    assert engine.counters[LookupAnswer.DEADLINE_MISS] == 2
    # Lookups work again: a fresh request gets a fresh check.
    engine.forget_request("r1")
    assert settle(engine, plain, "r3") is True
    assert settle(engine, newcomer, "r3") is True
    assert plain in probed[2:] and newcomer in probed[2:]


@pytest.mark.parametrize(("job_timeout_s", "lookup_timeout_s"), [(2.0, 2.0), (60.0, 5.0)])
def test_lookup_deadline_is_job_timeout_capped_at_5s(
    disk_root, engines, monkeypatch, job_timeout_s, lookup_timeout_s
):
    release = threading.Event()
    replace_checks(monkeypatch, lambda self, key: release.wait(GATE_TIMEOUT_S))
    engine, _, _ = engines(disk_root, n_blocks=4, job_timeout_s=job_timeout_s)
    lookups = inside(engine).lookups  # driven with an explicit clock instead of waiting 5 s
    try:
        assert engine.lookup(make_key("k"), "r") is None
        before = time.monotonic()
        engine.end_step()
        after = time.monotonic()
        assert not lookups.stuck(now=before + lookup_timeout_s - 0.1)
        assert lookups.expire_overdue(now=before + lookup_timeout_s - 0.1) == 0
        assert lookups.stuck(now=after + lookup_timeout_s)
        assert lookups.expire_overdue(now=after + lookup_timeout_s) == 1
        assert engine.lookup(make_key("k"), "r") is False
        # A guess, not a check: removal announcements must not trust it.
        assert lookups.guessed_miss(make_key("k"))
        lookups.set_verdict([make_key("k")], False)  # a load that failed: no finding either
        assert lookups.guessed_miss(make_key("k"))
        lookups.set_verdict([make_key("k")], True)  # a store that landed
        assert not lookups.guessed_miss(make_key("k"))
    finally:
        release.set()


# -- through vLLM's manager -----------------------------------------------------------------


def test_stuck_store_through_vllm_fails_cleanly_and_reset_completes(
    disk_root, replicas, monkeypatch, io_mode, engine_clock
):
    from vllm.v1.kv_offload.base import LookupResult

    from tests.kits.tier_kit import Replica, make_keys, offloading_config, ours, payload_for

    replica = Replica(offloading_config(tiers=[ours(disk_root, job_timeout_s=TIMEOUT_S)]))
    replicas.append(replica)
    engine = replica.tier.engine
    assert bool(engine.io_workers) == io_mode.workers
    gate = Gate(engine, io_mode.pause_dir, kinds=("store",))
    results = []
    real_finished = replica.tier.get_finished_jobs

    def spy_finished():
        got = list(real_finished())
        results.extend(got)
        return got

    monkeypatch.setattr(replica.tier, "get_finished_jobs", spy_finished)
    keys = make_keys(3, seed="stuck")
    try:
        replica.store(keys, settle=False)  # raises nothing into the "scheduler"
        held_by_executor(engine, 3)  # the three blocks are out, held or next in line
        gate.wait_entered(1)
        up_to_the_deadline(engine, engine_clock)
        replica.settle()  # steps until the manager has nothing in flight
        assert not gate.opened.is_set()
        assert [(r.success, r.transfer_bytes) for r in results] == [(False, 0)]
        assert engine.counters[Direction.STORE, Failure.DEADLINE] == 3
        assert inside(engine).recheck_stalled()
        # The chunks stay in the CPU tier: still a hit there.
        final, _ = replica.find(keys)
        assert final == dict.fromkeys(keys, LookupResult.HIT)

        # reset_cache drains the tier: must not wait for the stuck writes.
        done = threading.Event()

        def reset():
            with replica.manager.lock:
                replica.manager.reset_cache()
            done.set()

        thread = threading.Thread(target=reset, daemon=True)
        thread.start()
        assert done.wait(DEADLINE_S), "reset_cache blocked on a store the deadline failed"
        assert not gate.opened.is_set()
        with replica.manager.lock:
            replica.manager.on_reset_flushed()
    finally:
        gate.open()

    def recovered():
        replica.step()
        return not inside(engine).recheck_stalled()

    wait_until(recovered, "the stuck writes to return")
    assert all(not os.path.lexists(replica.tier.engine.roots[0].layout.block_path(k)) for k in keys)
    assert temp_files(disk_root) == []
    assert len(results) == 1  # the abandoned writes were not reported again

    fresh = make_keys(2, seed="after")
    replica.store(fresh)
    assert results[-1].success
    for key in fresh:
        with open(replica.tier.engine.roots[0].layout.block_path(key), "rb") as f:
            assert f.read(replica.row_bytes) == payload_for(key, replica.row_bytes)
