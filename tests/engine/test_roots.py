"""Several roots, one engine (path_sharding: by_block_hash), on real tmpfs
mounts, in both io modes: each block whole on its home root, every root a
valid cache by itself, a root added later still finds the blocks written
before, one root lost or full costs only its blocks, and bad lists are
refused before anything is created."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmkv_fs.engine import Direction, Failure, LookupAnswer
from llmkv_fs.layout.placement import RootPlacement
from llmkv_fs.rootlist import RootListError
from tests.kits import REPO
from tests.kits.engine_kit import (
    BS,
    fill,
    inside,
    make_key,
    pattern,
    settle,
    store_blocks,
    wait_jobs,
    wait_until,
    write_blocks,
)
from tests.kits.volume_kit import BindVolume, block_files, write_filler

SHARDED = {"path_sharding": "by_block_hash"}
N = 24


def two_roots(mount_tmpfs) -> list[str]:
    return [mount_tmpfs("32m"), mount_tmpfs("32m")]


def home_of(roots: list[str], i: int) -> str:
    return roots[RootPlacement(roots).home(make_key(i))]


def block_names(root: str) -> set[str]:
    return {os.path.basename(path) for path in block_files(root)}


def load_all(engine, primary, ids, job_id: int):
    keys = [make_key(i) for i in ids]
    primary[: len(ids) * BS] = bytes(len(ids) * BS)
    assert engine.submit_load(job_id, keys, list(range(len(ids))))
    return wait_jobs(engine, [job_id])[job_id]


def test_each_block_is_stored_whole_on_its_home_root_and_loads_back(mount_tmpfs, engines):
    roots = two_roots(mount_tmpfs)
    engine, _, primary = engines(",".join(roots), n_blocks=N, **SHARDED)
    store_blocks(engine, primary, 1, range(N), range(N))
    for root in roots:  # every root is a cache by itself: config.json and its blocks
        assert os.path.isfile(engine.roots[roots.index(root)].layout.config_path)
    on_disk = {root: block_names(root) for root in roots}
    for i in range(N):
        name = os.path.basename(engine.roots[0].layout.block_path(make_key(i)))
        home = home_of(roots, i)
        assert name in on_disk[home] and all(name not in on_disk[r] for r in roots if r != home)
    assert all(on_disk[root] for root in roots), "24 blocks all placed on one root"
    job = load_all(engine, primary, range(N), 2)
    assert job.success
    for i in range(N):
        assert bytes(primary[i * BS : (i + 1) * BS]) == pattern(i)
    stored = {r: engine.root_counters[i, Direction.STORE, True] for i, r in enumerate(roots)}
    assert stored == {r: len(on_disk[r]) for r in roots}


def test_a_root_added_later_still_finds_the_blocks_written_before(mount_tmpfs, engines):
    first, second, added = mount_tmpfs("32m"), mount_tmpfs("32m"), mount_tmpfs("32m")
    before, _, primary = engines(f"{first},{second}", n_blocks=N, **SHARDED)
    store_blocks(before, primary, 1, range(N), range(N))
    before.shutdown()

    grown = [first, second, added]
    engine, _, primary = engines(",".join(grown), n_blocks=N, **SHARDED)
    moved = [i for i in range(N) if home_of(grown, i) == added]
    assert moved, "no block's home moved to the added root (24 keys)"
    assert all(settle(engine, make_key(i), "after") for i in range(N))
    job = load_all(engine, primary, range(N), 2)
    assert job.success
    assert all(bytes(primary[i * BS : (i + 1) * BS]) == pattern(i) for i in range(N))
    # A new store of a moved key goes to its new home.
    fill(primary, 0, pattern(moved[0]))
    assert engine.submit_store(3, [make_key(moved[0])], [0])
    assert wait_jobs(engine, [3])[3].success
    name = os.path.basename(engine.roots[0].layout.block_path(make_key(moved[0])))
    assert name in block_names(added)


def test_a_load_whose_home_root_is_replaced_midway_reads_its_second_choice(
    tmp_path, engines, gate_for
):
    """Issue 25: a load past the lost-root checks (held at its read) whose
    home root is then replaced goes on to the block's second choice, where
    the block was written before the home root was added."""
    roots = [str(tmp_path / "home"), str(tmp_path / "second")]
    ids = [i for i in range(40) if home_of(roots, i) == roots[0]][:1]
    write_blocks(roots[1], ids)  # written while "second" was the only root
    engine, _, primary = engines(",".join(roots), n_blocks=4, **SHARDED)
    gate = gate_for(engine, kinds=("load",), point="read")
    assert engine.submit_load(1, [make_key(ids[0])], [0])
    gate.wait_entered(1)
    os.rename(roots[0], tmp_path / "old-home")
    os.mkdir(roots[0])
    gate.open()
    assert wait_jobs(engine, [1])[1].success
    assert bytes(primary[:BS]) == pattern(ids[0])


def test_a_jobs_blocks_on_both_roots_move_at_the_same_time(mount_tmpfs, engines, gate_for):
    roots = two_roots(mount_tmpfs)
    engine, _, primary = engines(",".join(roots), n_blocks=8, **SHARDED)
    on_first = [i for i in range(40) if home_of(roots, i) == roots[0]][:2]
    on_second = [i for i in range(40) if home_of(roots, i) == roots[1]][:2]
    ids = [on_first[0], on_second[0], on_first[1], on_second[1]]  # the job alternates roots
    store_blocks(engine, primary, 1, ids, range(4))
    # On tmpfs with 2 CPUs the engine runs 1 + 1 I/O threads (startup/io_setup.py,
    # io_thread_counts): as many places as it has, up to the job's four.
    places = min(4, inside(engine).executor.capacity())
    gate = gate_for(engine, point="read")  # past every check, at the read of its root
    assert engine.submit_load(2, [make_key(i) for i in ids], [4, 5, 6, 7])
    gate.wait_entered(places)  # one job, both roots, every place at once
    entered = {key for _place, _kind, key in gate.entries}
    assert {home_of(roots, i) for i in ids if make_key(i) in entered} == set(roots)
    assert len({place for place, _kind, _key in gate.entries}) == places
    gate.open()
    assert wait_jobs(engine, [2])[2].success
    assert all(bytes(primary[(4 + n) * BS : (5 + n) * BS]) == pattern(i) for n, i in enumerate(ids))


def test_a_reordered_list_finds_every_block(mount_tmpfs, engines):
    roots = two_roots(mount_tmpfs)
    engine, _, primary = engines(",".join(roots), n_blocks=N, **SHARDED)
    store_blocks(engine, primary, 1, range(N), range(N))
    engine.shutdown()
    engine, _, primary = engines(",".join(reversed(roots)), n_blocks=N, **SHARDED)
    assert all(settle(engine, make_key(i), "reordered") for i in range(N))
    assert inside(engine).lookups is not None
    job = load_all(engine, primary, range(N), 2)
    assert job.success


def _keys_by_home(roots: list[str], ids) -> dict[str, list[int]]:
    by_home: dict[str, list[int]] = {root: [] for root in roots}
    for i in ids:
        by_home[home_of(roots, i)].append(i)
    return by_home


def test_a_lost_root_costs_only_its_blocks(tmp_path, mount_tmpfs, engines):
    lost = BindVolume(tmp_path)
    try:
        roots = [mount_tmpfs("32m"), lost.mountpoint]
        engine, _, primary = engines(",".join(roots), n_blocks=N, **SHARDED)
        store_blocks(engine, primary, 1, range(8), range(8))
        by_home = _keys_by_home(roots, range(8, N))
        assert by_home[roots[0]] and by_home[roots[1]]

        lost.unmount()
        wait_until(lambda: engine.root_gauges()[roots[1]]["volume_failed"] == 1, "the loss")
        assert engine.root_gauges()[roots[0]]["volume_failed"] == 0
        ids = list(range(8, N))
        for i in ids:
            fill(primary, i, pattern(i))
        assert engine.submit_store(2, [make_key(i) for i in ids], ids)  # not refused whole
        job = wait_jobs(engine, [2])[2]
        assert sorted(job.succeeded) == sorted(make_key(i) for i in by_home[roots[0]])
        lost_count = len(by_home[roots[1]])
        assert engine.counters[Direction.STORE, Failure.ROOT_LOST] == lost_count
        assert os.listdir(lost.mountpoint) == []  # nothing created underneath the mount

        engine.end_step()
        verdicts = {i: settle(engine, make_key(i), "during") for i in range(8)}
        assert verdicts == {i: home_of(roots, i) == roots[0] for i in range(8)}
        assert engine.counters[LookupAnswer.MISS] >= sum(not v for v in verdicts.values())

        lost.mount()
        wait_until(lambda: engine.root_gauges()[roots[1]]["volume_failed"] == 0, "its return")
        engine.end_step()
        job = load_all(engine, primary, range(8), 3)  # the blocks of both roots again
        assert job.success
    finally:
        lost.close()


def test_a_full_root_refuses_only_its_stores(mount_tmpfs, engines):
    roots = [mount_tmpfs("8m"), mount_tmpfs("32m")]
    engine, _, primary = engines(",".join(roots), n_blocks=N, max_usage_percent=50, **SHARDED)
    write_filler(f"{roots[0]}/filler", 5 * 1024 * 1024)  # another writer fills root 0
    for guard in (root.guard for root in engine.roots):
        guard.sample()  # as the housekeeping thread does about once a second
    gauges = engine.root_gauges()
    assert (gauges[roots[0]]["space_guard_tripped"], gauges[roots[1]]["space_guard_tripped"]) == (
        1,
        0,
    )
    ids = list(range(N))
    by_home = _keys_by_home(roots, ids)
    for i in ids:
        fill(primary, i, pattern(i))
    assert engine.submit_store(1, [make_key(i) for i in ids], ids)
    job = wait_jobs(engine, [1])[1]
    assert sorted(job.succeeded) == sorted(make_key(i) for i in by_home[roots[1]])
    assert engine.counters[Direction.STORE, Failure.SPACE] == len(by_home[roots[0]])
    assert engine.root_counters[0, Direction.STORE, False] == len(by_home[roots[0]])
    assert engine.root_counters[1, Direction.STORE, True] == len(by_home[roots[1]])


def test_a_missing_root_is_created_with_its_parents(tmp_path, engines):
    roots = [str(tmp_path / "a" / "deep" / "kv"), str(tmp_path / "b" / "kv")]
    engine, _, _ = engines(",".join(roots), **SHARDED)
    assert all(os.path.isdir(root.layout.rank_dir) for root in engine.roots)


@pytest.mark.parametrize("case", ["symlink", "bind", "nested-by-link", "nested"])
def test_one_directory_listed_twice_is_refused_before_anything_is_created(
    case, tmp_path, mount_tmpfs, engines
):
    real = tmp_path / "real"
    real.mkdir()
    other = tmp_path / "other"
    if case == "symlink":
        os.symlink(real, tmp_path / "link")
        roots, words = [str(real), str(tmp_path / "link")], "are the same directory"
    elif case == "bind":
        volume = mount_tmpfs("4m")
        twin = tmp_path / "twin"
        twin.mkdir()
        os.system(f"mount --bind {volume} {twin}")
        if not os.path.ismount(twin):
            pytest.skip("cannot bind-mount here")
        roots, words = [volume, str(twin)], "are the same directory"
    elif case == "nested-by-link":
        os.symlink(real, tmp_path / "link")
        roots, words = [str(real), str(tmp_path / "link" / "inner")], "lies inside"
    else:
        roots, words = [str(real), str(real / "inner")], "lies inside"
    roots.append(str(other))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(RootListError, match=words) as info:
        engines(",".join(roots), **SHARDED)
    assert "entry 2" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == before  # nothing created, not even "other"
    assert os.listdir(real) == []
    if case == "bind":
        os.system(f"umount -l {tmp_path / 'twin'}")


@pytest.mark.parametrize("bad", ["a-file", "a-symlink", "proc", "below-a-file"])
def test_a_bad_later_entry_is_refused_before_the_first_is_touched(bad, tmp_path, engines):
    """Issue 25: every entry of the list is checked -- spelling and
    filesystem -- before anything is created in any of them (a refused list
    once left the good first root with a new digest directory)."""
    good = tmp_path / "good"
    good.mkdir()
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    entry = {
        "a-file": str(blocker),
        "a-symlink": str(tmp_path / "link"),
        "proc": "/proc/llmkv_fs_kv",
        "below-a-file": str(blocker / "kv"),
    }[bad]
    with pytest.raises(OSError, match="root_dir") as info:
        engines(f"{good},{entry}", **SHARDED)
    assert entry in str(info.value)
    assert os.listdir(good) == []
    assert os.listdir(tmp_path / "real") == []
    assert blocker.read_bytes() == b"not a directory"


# Replica B, in a mount namespace of its own where client B's view of the
# volume is bound over client A's path: the same root spelling (placement is
# by spelling, and every pod mounts at the same path) through the other client.
_READER = """
import json, mmap, os, sys
from llmkv_fs.config import TierSettings
from llmkv_fs.engine import FsEngine
from llmkv_fs.layout.paths import CacheLayout
from tests.kits.engine_kit import BS, IDENTITY, make_key, memfd_primary, pattern, settle, wait_jobs
roots, n, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
settings = TierSettings(root_dir=roots, path_sharding="by_block_hash", io_workers=workers,
                        n_read_threads=2, n_write_threads=2, lookup_threads=2)
layouts = [CacheLayout.for_identity(r, IDENTITY) for r in settings.root_dirs]
primary = memfd_primary(n * BS)
engine = FsEngine(settings, layouts, primary, BS)
hits = [settle(engine, make_key(i), "b") for i in range(n)]
engine.submit_load(1, [make_key(i) for i in range(n)], list(range(n)))
job = wait_jobs(engine, [1])[1]
right = [bytes(primary[i * BS:(i + 1) * BS]) == pattern(i) for i in range(n)]
engine.shutdown()
print(json.dumps({"hits": hits, "loaded": job.success, "right": right,
                  "workers": engine.io_workers}))
"""


def test_two_roots_shared_through_another_client(shared_volume, engines, io_mode):
    roots_a = [os.path.join(shared_volume.a, name) for name in ("r0", "r1")]
    engine_a, _, primary_a = engines(",".join(roots_a), n_blocks=N, **SHARDED)
    store_blocks(engine_a, primary_a, 1, range(N), range(N))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    workers = 2 if io_mode.workers else 0
    bind = f"mount --bind {shared_volume.b} {shared_volume.a}"
    reader = f"{sys.executable} -c '{_READER}' {','.join(roots_a)} {N} {workers}"
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", f"{bind} && {reader}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if done.returncode and "unshare failed" in done.stderr:
        pytest.skip(f"no mount namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["workers"] == workers
    assert seen["hits"] == [True] * N and seen["loaded"] and seen["right"] == [True] * N


def _fds_on(path: str) -> list[str]:
    """This process's descriptors of ``path`` itself."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == path:
                found.append(fd)
        except OSError:
            continue
    return found


def test_shutdown_leaves_no_descriptor_of_a_root_in_the_calling_thread(tmp_path, engines):
    """The owner's thread (vLLM's scheduler) resolved names below each root
    while the engine ran; once shutdown returns it holds no descriptor of a
    root (an unmount of the volume then finds it unused by us)."""
    roots = [str(tmp_path / "a" / "kv"), str(tmp_path / "b" / "kv")]
    engine, _layout, _primary = engines(",".join(roots), n_blocks=4, path_sharding="by_block_hash")
    for root in engine.roots:  # what a tool or the owner may do on its own thread
        root.blockio.exists(make_key(0))
    assert all(_fds_on(root) for root in roots)
    engine.shutdown()
    assert [fd for root in roots for fd in _fds_on(root)] == []
