"""Fault matrix, I/O errors through vLLM's real TieringOffloadingManager:
damaged files (before the lookup, and between the lookup's HIT and the load),
a file deleted between HIT and load, a real kernel EIO, EACCES for a replica
running as ``nobody``, a read-only remount mid-run, and the start-up errors
for a bad root_dir.

Every test ends the same way: no wrong KV byte reached the CPU tier, no
exception reached the scheduler (TierClock), and the failure was counted.
"""

import contextlib
import os
import shutil
import uuid

import pytest

from llmkv_fs.engine import Direction, EngineError, Failure, Outcome, Tally
from llmkv_fs.layout.blockfile import Corruption
from tests.kits.engine_kit import Gate, inside
from tests.kits.matrix_kit import (
    DAMAGES,
    HIT,
    HIT_PENDING,
    MISS,
    RETRY,
    Forked,
    TierClock,
    block_problem,
    ext4_shutdown,
    gluster_dirs,
    lookup_until,
    loop_ext4,
    nobody,
    record,
    remount,
    served,
    temp_owner,
)
from tests.kits.tier_kit import Replica, make_keys, offloading_config, ours, start, wait_until
from tests.kits.volume_kit import block_files, temp_files

# Our tier in both io modes (I/O threads, worker processes).
pytestmark = pytest.mark.usefixtures("io_mode")

# One lookup round trip on the lookup thread; the test polls every ~2 ms, so
# this is a time bound of a second or two on a busy machine, not a tight one.
MAX_STEPS_TO_MISS = 500


def start_clocked(replicas, root, **tier):
    """A replica over ``root`` and the clock that times its tier's calls."""
    replica = start(replicas, ours(root, **tier))
    return replica, TierClock(replica.tier)


def assert_no_livelock(history) -> None:
    """A key that failed resolves to MISS the plain way: RETRY while the
    off-thread existence check runs (steps of a few ms each), then MISS --
    no promotion started again (HIT_PENDING), and a bounded number of steps."""
    assert {r for step in history[:-1] for r in step} <= {RETRY}, history
    assert set(history[-1]) == {MISS}
    assert len(history) <= MAX_STEPS_TO_MISS


def assert_fresh_requests_miss(reader, clock, keys, requests: int = 1) -> None:
    """Fresh requests for ``keys``: each a plain MISS, no load submitted again,
    nothing raised into the scheduler."""
    loads_before = clock.calls["submit_load"]
    for _ in range(requests):
        verdict, history = reader.find(keys)
        assert verdict == dict.fromkeys(keys, MISS)
        assert_no_livelock(history)
    assert clock.calls["submit_load"] == loads_before
    assert clock.errors == []


# -- damaged block files -------------------------------------------------------------------


@pytest.mark.parametrize("when", ["before-lookup", "after-hit"])
def test_damaged_files_are_never_served(shared_volume, replicas, when, io_mode):
    """Five damages in one request next to four good blocks. Damaged blocks:
    MISS, never loaded (a failed load is reported, not served), quarantined
    once read, counted by reason; good blocks: HIT, byte exact (vLLM's
    partial success). Replica A writes and damages through its mount, B reads
    through its own."""
    writer, _ = start_clocked(replicas, shared_volume.a)
    good = make_keys(4, seed=f"good-{when}")
    bad = dict(zip(DAMAGES, make_keys(len(DAMAGES), seed=f"bad-{when}")))
    keys = good + list(bad.values())
    writer.store(keys)
    donor = writer.tier.engine.roots[0].layout.block_path(good[0])

    def damage():
        for name, key in bad.items():
            DAMAGES[name][0](writer.tier.engine.roots[0].layout.block_path(key), donor)

    reader, clock = start_clocked(replicas, shared_volume.b)
    # A request per damaged block: a load job stops at its first bad block
    # (vLLM's prefix rule), so each damage needs a job of its own to be read.
    requests = [(reader.new_request(), good)] + [(reader.new_request(), [k]) for k in bad.values()]
    if when == "before-lookup":
        damage()
    else:
        # The tier said HIT for every request; loads are next. They are held
        # until the damage is done: where lookups answer over several steps
        # (NFS in the emulated guest), vLLM promotes the first requests'
        # blocks before the last ones answer, and a load that ran before the
        # damage rightly serves the undamaged block.
        gate = Gate(reader.tier.engine, io_mode.pause_dir, kinds=("load",))

        def all_promoting() -> bool:
            with reader.manager.lock:
                found = [reader.manager.lookup(k, c) for c, ks in requests for k in ks]
            if set(found) <= {HIT_PENDING}:
                return True
            assert set(found) <= {HIT_PENDING, RETRY}, found
            reader.step()
            return False

        try:
            wait_until(all_promoting, "every request to promote")
            damage()
        finally:
            gate.open()
    final: dict = {}
    hits = wrong = 0
    for ctx, ks in requests:
        found, _ = reader.find(ks, ctx)
        final.update(found)
        h, w = served(reader, ks, found, ctx)
        hits, wrong = hits + h, wrong + w
    assert wrong == 0
    assert final == {**dict.fromkeys(good, HIT), **dict.fromkeys(bad.values(), MISS)}
    with reader.manager.lock:  # nothing of a bad block sits in the CPU tier
        for ctx, (key,) in requests[1:]:
            assert reader.manager.primary_tier.lookup(key, ctx) is MISS

    counters = reader.tier.engine.counters
    loaded_bad = [
        n for n, (_, _, size_fails) in DAMAGES.items() if when == "after-hit" or not size_fails
    ]
    expected = {}
    for name in loaded_bad:
        expected[DAMAGES[name][1]] = expected.get(DAMAGES[name][1], 0) + 1
    assert {
        f"load_corrupt_{k}": v for k, v in counters.items() if isinstance(k, Corruption)
    } == expected
    assert counters[Tally.QUARANTINED] == len(loaded_bad)
    quarantine = sorted(os.listdir(reader.tier.engine.roots[0].layout.quarantine_dir))
    assert len(quarantine) == len(loaded_bad)
    for name in loaded_bad:  # each moved aside, named by its reason, gone from its path
        path = reader.tier.engine.roots[0].layout.block_path(bad[name])
        assert not os.path.lexists(path)
        reason = DAMAGES[name][1].removeprefix("load_corrupt_")
        assert any(q.startswith(os.path.basename(path)) and f".{reason}." in q for q in quarantine)
    for name in set(DAMAGES) - set(loaded_bad):  # odd sizes never pass the lookup
        assert os.path.exists(reader.tier.engine.roots[0].layout.block_path(bad[name]))

    # A fresh request: MISS at once, no second load, no livelock.
    for ctx, _ in requests:
        reader.finish_request(ctx)
    assert_fresh_requests_miss(reader, clock, list(bad.values()))
    record(
        "damaged_files",
        fs=shared_volume.fs,
        when=when,
        damaged=len(bad),
        good=len(good),
        served=hits,
        wrong=wrong,
        quarantined=counters[Tally.QUARANTINED],
        corrupt_counted=sum(expected.values()),
        scheduler_exceptions=len(clock.errors),
    )


def test_file_deleted_between_hit_and_load_fails_only_that_key(shared_volume, replicas):
    writer, _ = start_clocked(replicas, shared_volume.a)
    keys = make_keys(4, seed="deleted")
    writer.store(keys)
    reader, clock = start_clocked(replicas, shared_volume.b)
    ctx = reader.new_request()
    assert set(lookup_until(reader, keys, ctx).values()) == {HIT_PENDING}
    os.unlink(writer.tier.engine.roots[0].layout.block_path(keys[1]))  # another replica's gc, say

    final, _ = reader.find(keys, ctx)
    hits, wrong = served(reader, keys, final, ctx)
    # Only the blocks before the failed one are kept, as vLLM's built-in does.
    assert final == {keys[0]: HIT, keys[1]: MISS, keys[2]: MISS, keys[3]: MISS}
    assert (hits, wrong) == (1, 0)
    counters = reader.tier.engine.counters
    # ENOENT; through a second GlusterFS client possibly ESTALE (a load error).
    missing = counters[Direction.LOAD, Failure.MISSING]
    errors = counters[Direction.LOAD, Failure.ERROR]
    assert missing + errors == 1
    assert counters[Direction.LOAD, Failure.SKIPPED] == 2
    assert counters[Tally.QUARANTINED] == 0

    reader.finish_request(ctx)
    # Fresh requests keep asking: a bounded MISS every time.
    assert_fresh_requests_miss(reader, clock, [keys[1]], requests=20)
    record(
        "deleted_after_hit",
        fs=shared_volume.fs,
        keys=4,
        served=hits,
        wrong=wrong,
        load_missing=missing,
        load_errors=errors,
        scheduler_exceptions=len(clock.errors),
    )


# -- EIO, EACCES, read-only ----------------------------------------------------------------


def test_eio_fails_loads_and_stores_cleanly(tmp_path, replicas):
    """A loop-mounted ext4 shut down under a running replica (EXT4_IOC_SHUTDOWN):
    every read, write, create and rename now gets EIO from the kernel."""
    with loop_ext4(tmp_path / "eio") as root:
        writer, _ = start_clocked(replicas, root)
        keys = make_keys(4, seed="eio")
        writer.store(keys)
        reader, clock = start_clocked(replicas, root)
        ctx = reader.new_request()
        assert set(lookup_until(reader, keys, ctx).values()) == {HIT_PENDING}
        ext4_shutdown(root)

        final, _ = reader.find(keys, ctx)  # the loads run now and get EIO
        hits, wrong = served(reader, keys, final, ctx)
        assert final == dict.fromkeys(keys, MISS)
        counters = reader.tier.engine.counters
        # The first EIO ends the job: blocks not yet started are skipped.
        load_errors = counters[Direction.LOAD, Failure.ERROR]
        assert load_errors >= 1
        assert load_errors + counters[Direction.LOAD, Failure.SKIPPED] == len(keys)
        assert counters[Tally.QUARANTINED] == 0  # an unreadable file is not a bad file

        fresh = make_keys(3, seed="eio-store")
        reader.store(fresh)  # settles; the primary keeps them, the tier fails them
        assert counters[Direction.STORE, Failure.ERROR] == len(fresh)
        assert counters[Outcome.WRITTEN] == 0
        assert reader.tier.engine.roots[0].guard.allows_store()  # EIO is not a full volume
        final, _ = reader.find(fresh)
        assert final == dict.fromkeys(fresh, HIT)  # served from the CPU tier
        assert clock.errors == []
        for replica in (reader, writer):
            # Removing the lease would raise EIO out of shutdown: that bug has
            # its own test below; here the replicas just have to go.
            replica.tier.engine.roots[0].housekeeping.lease_path = None
            replicas.remove(replica)
            replica.close()
    record(
        "eio_ext4_shutdown",
        loads_failed=load_errors,
        stores_failed=counters[Direction.STORE, Failure.ERROR],
        served=hits,
        wrong=wrong,
        scheduler_exceptions=len(clock.errors),
    )


def test_shutdown_on_a_failed_volume_does_not_raise(tmp_path):
    with loop_ext4(tmp_path / "eio-shutdown") as root:
        replica = Replica(offloading_config(tiers=[ours(root)]))
        replica.step()  # the first step publishes this tier's lease
        wait_until(
            lambda: replica.tier.engine.roots[0].housekeeping.lease_path is not None, "the lease"
        )
        ext4_shutdown(root)
        try:
            replica.close()
        except OSError:  # do what shutdown skipped, so nothing leaks past this test
            replica.tier.engine._flat.release()
            replica.manager.primary_tier.shutdown()
            raise


@pytest.fixture(params=["tmpfs", "ext4", "gluster"])
def open_root(request):
    """A root directory user nobody can reach (pytest's tmp dirs are 0700)."""
    tag = uuid.uuid4().hex[:8]
    if request.param == "gluster":
        root, _ = gluster_dirs(request.getfixturevalue("gluster"), tag)
    else:
        root = f"{'/dev/shm' if request.param == 'tmpfs' else '/var/tmp'}/llmkv_matrix_{tag}"
        os.makedirs(root)
    yield request.param, root
    shutil.rmtree(root, ignore_errors=True)


def _nobody_reads_and_writes(root: str, keys_hex: list[str], fresh_hex: list[str]) -> dict:
    keys = [bytes.fromhex(k) for k in keys_hex]
    fresh = [bytes.fromhex(k) for k in fresh_hex]
    replica = Replica(offloading_config(tiers=[ours(root)]))
    try:  # the child ends with os._exit: close, or the /dev/shm region stays
        clock = TierClock(replica.tier)
        ctx = replica.new_request()
        final, _ = replica.find(keys, ctx)
        hits, wrong = served(replica, keys, final, ctx)
        replica.store(fresh)
        counters = replica.tier.engine.counters
        return {
            "uid": os.getuid(),
            "verdicts": sorted({v.name for v in final.values()}),
            "served": hits,
            "wrong": wrong,
            "errors": clock.errors,
            "counters": {
                "load_errors": counters[Direction.LOAD, Failure.ERROR],
                "load_skipped": counters[Direction.LOAD, Failure.SKIPPED],
                "store_errors": counters[Direction.STORE, Failure.ERROR],
                "quarantined": counters[Tally.QUARANTINED],
            },
        }
    finally:
        replica.close()


def test_eacces_as_nobody_fails_loads_and_stores_cleanly(open_root, replicas):
    fs, root = open_root
    owner, _ = start_clocked(replicas, root, file_mode=0o600, dir_mode=0o755)
    keys = make_keys(4, seed="eacces")
    owner.store(keys)
    os.chmod(root, 0o777)  # nobody may start a tier here...
    os.chmod(owner.tier.engine.roots[0].layout.config_path, 0o644)  # ...and read the run config
    fresh = make_keys(3, seed="eacces-fresh")

    got = Forked(
        _nobody_reads_and_writes,
        root,
        [k.hex() for k in keys],
        [k.hex() for k in fresh],
        user=nobody(),
    ).result()
    assert got["uid"] == nobody()[0]
    assert got["errors"] == [] and got["wrong"] == 0
    assert got["verdicts"] == ["MISS"]  # found (lstat), unreadable: recomputed
    counters = got["counters"]
    # The first EACCES ends the load job: blocks not yet started are skipped.
    assert counters["load_errors"] >= 1
    assert counters["load_errors"] + counters["load_skipped"] == len(keys)
    assert counters["store_errors"] == len(fresh)
    assert counters["quarantined"] == 0
    assert sorted(block_files(owner.tier.engine.roots[0].layout.rank_dir)) == sorted(
        owner.tier.engine.roots[0].layout.block_path(k) for k in keys
    )
    assert temp_files(root) == []
    record(
        "eacces_nobody",
        fs=fs,
        loads_failed=counters["load_errors"],
        stores_failed=counters["store_errors"],
        wrong=got["wrong"],
        scheduler_exceptions=len(got["errors"]),
    )


@pytest.mark.parametrize("kind", ["tmpfs", "ext4"])
def test_read_only_remount_mid_run_fails_stores_loads_continue(
    kind, tmp_path, replicas, mount_tmpfs
):
    with contextlib.ExitStack() as stack:
        root = (
            mount_tmpfs("64m")
            if kind == "tmpfs"
            else stack.enter_context(loop_ext4(tmp_path / "ro-ext4"))
        )
        writer, wclock = start_clocked(replicas, root)
        reader, rclock = start_clocked(replicas, root)
        before = make_keys(4, seed="ro-before")
        writer.store(before)
        racing = make_keys(8, seed="ro-racing")
        writer.store(racing, settle=False)  # in flight while the volume turns read-only
        remount(root, "ro")
        writer.settle()
        after = make_keys(4, seed="ro-after")
        writer.store(after)
        counters = writer.tier.engine.counters
        assert counters[Direction.STORE, Failure.ERROR] >= len(after)
        assert counters[Outcome.WRITTEN] == len(before) + len(racing) - (
            counters[Direction.STORE, Failure.ERROR] - len(after)
        )

        ctx = reader.new_request()  # loads go on from the read-only volume
        final, _ = reader.find(before + after, ctx)
        hits, wrong = served(reader, before + after, final, ctx)
        assert final == {**dict.fromkeys(before, HIT), **dict.fromkeys(after, MISS)}
        assert wrong == 0 and reader.tier.engine.counters[Outcome.VERIFIED] == len(before)
        for path in block_files(root):  # what was published before the remount is whole
            key = next(
                k
                for k in before + racing
                if writer.tier.engine.roots[0].layout.block_path(k) == path
            )
            assert block_problem(path, key) is None
        # A store caught between its write and its rename cannot remove its
        # temp file on a read-only volume; it is ours -- this process's or
        # one of its I/O workers' (gc removes it later).
        leftovers = temp_files(root)
        writers = {os.getpid(), *inside(writer.tier.engine).executor.worker_pids()}
        assert {temp_owner(p) for p in leftovers} <= writers

        remount(root, "rw")  # and it recovers
        again = make_keys(2, seed="ro-again")
        writer.store(again)
        final, _ = reader.find(again)
        assert final == dict.fromkeys(again, HIT)
        assert wclock.errors == [] and rclock.errors == []
        for replica in (reader, writer):
            replicas.remove(replica)
            replica.close()
    record(
        "read_only_remount",
        fs=kind,
        stores_failed=counters[Direction.STORE, Failure.ERROR],
        temp_left=len(leftovers),
        loads_ok=len(before),
        served=hits,
        wrong=wrong,
        scheduler_exceptions=0,
    )


# -- start-up: a bad root_dir -------------------------------------------------------------


def _start_as_nobody(root: str) -> str:
    try:
        Replica(offloading_config(tiers=[ours(root)])).close()
    except EngineError as exc:
        return str(exc)
    return "started"


@pytest.mark.parametrize("case", ["a-file", "a-symlink", "unwritable"])
def test_bad_root_dir_is_a_clear_startup_error(case, tmp_path):
    root = str(tmp_path / "kv")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if case == "a-file":
        with open(root, "w") as f:
            f.write("not a directory")
    elif case == "a-symlink":
        os.symlink(elsewhere, root)
    if case == "unwritable":  # root bypasses permissions: try it as nobody
        root = f"/dev/shm/llmkv_matrix_ro_{uuid.uuid4().hex[:8]}"
        os.mkdir(root, 0o755)
        try:
            message = Forked(_start_as_nobody, root, user=nobody()).result()
            assert os.listdir(root) == []
        finally:
            shutil.rmtree(root)
    else:
        with pytest.raises(EngineError) as info:
            Replica(offloading_config(tiers=[ours(root)]))
        message = str(info.value)
    fix = {
        "a-file": "Point root_dir at a directory",
        "a-symlink": "Set root_dir to the real directory",
        "unwritable": f"not writable by uid {nobody()[0]}. Fix its ownership/mode",
    }[case]
    assert repr(root) in message and fix in message, message
    assert os.listdir(elsewhere) == []  # nothing was created through the link
