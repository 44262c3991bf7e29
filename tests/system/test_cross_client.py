"""What one replica sees of another's work through a second client of the
same volume (``shared_volume``: on NFS two kernel clients with their own
caches, tests/kits/nfs_kit.py; on local filesystems the same directory):
lookups after a miss, NFS's silly-renamed ``.nfs<hex>`` files under gc,
stats and verify, a digest removed under a reader, config.json and lease
heartbeats read across clients."""

from __future__ import annotations

import collections
import json
import os
import time

from llmkv_fs import cli
from llmkv_fs.engine import Direction, Failure
from llmkv_fs.engine.block.blockio import BlockIO
from llmkv_fs.layout.names import is_silly_rename_name, trash_path
from llmkv_fs.ops.gc.actions import delete_tree
from llmkv_fs.ops.problems import Problems
from llmkv_fs.volume.files import read_small_regular_file, write_file_atomically_at
from llmkv_fs.volume.leases import Lease, read_leases, refresh_lease, write_lease
from tests.kits.engine_kit import (
    BS,
    make_key,
    pattern,
    settle,
    store_blocks,
    wait_jobs,
    wait_until,
    write_blocks,
)
from tests.kits.gc_kit import DAY, age

# GlusterFS's FUSE mount keeps a looked-up name this long (its default).
FUSE_ENTRY_TIMEOUT_S = 1.0
# Linux's silly-rename name: ".nfs" + 16 hex digits of file id + 8 of a counter.
SILLY = ".nfs000000000012d68700000001"


def test_a_block_stored_after_a_miss_is_seen_by_the_next_lookup(
    shared_volume, engines, monkeypatch
):
    """NFS clients keep a missed name missing for acdirmin..acdirmax (30-60 s)
    after another client creates it; the engine must see it in one batch:
    the first check after the store finds it (not a later one, once the
    attribute cache let go)."""
    checks = collections.Counter()
    real_exists, real_many = BlockIO.exists, BlockIO.exists_many

    def counted(self, key):
        checks[key] += 1
        return real_exists(self, key)

    def counted_many(self, keys, budget_s=0.0):  # the compiled check, where it runs
        found = real_many(self, keys, budget_s)
        checks.update(keys[: len(found)])
        return found

    monkeypatch.setattr(BlockIO, "exists", counted)
    monkeypatch.setattr(BlockIO, "exists_many", counted_many)
    engine_b, _, _ = engines(shared_volume.b)
    engine_a, _, primary_a = engines(shared_volume.a)
    # Key 0's shard directory exists on both sides before the miss; key 1's
    # does not (a negative entry for a directory, one level up).
    store_blocks(engine_a, primary_a, 1, [100], [0])
    assert settle(engine_b, make_key(100), "warm") is True
    keys = [make_key(i) for i in range(2)]
    assert [settle(engine_b, k, "before") for k in keys] == [False, False]
    engine_b.forget_request("before")

    store_blocks(engine_a, primary_a, 2, [0, 1], [1, 2])
    checks.clear()
    assert [settle(engine_b, k, "after") for k in keys] == [True, True]
    # One check each, which saw the file: no retry until an attribute cache
    # expired (measured ~30 s on NFS without revalidating after a miss).
    assert checks == dict.fromkeys(keys, 1)


def _silly_rename(layout, blockio, key: bytes, root_b: str | None):
    """An open-and-unlinked block as an NFS client leaves it: the real thing
    on NFS (client A unlinks a block it holds open), a planted ``.nfs`` file
    elsewhere. Returns (fd held open or None, the .nfs path)."""
    path = layout.block_path(key)
    if root_b is None:
        planted = os.path.join(os.path.dirname(path), SILLY)
        os.rename(path, planted)
        return None, planted
    fd = os.open(path, os.O_RDONLY)
    os.unlink(path)
    directory = os.path.dirname(path)
    (name,) = [n for n in os.listdir(directory) if is_silly_rename_name(n)]
    return fd, os.path.join(directory, name)


def test_silly_renamed_files_are_never_removed_counted_or_taken_for_use(shared_volume, capsys):
    layout, blockio = write_blocks(shared_volume.a, range(4))
    for i in range(4):
        age(layout.block_path(make_key(i)), 8 * DAY, 8 * DAY)
    age(os.path.join(layout.base_path, "config.json"), 8 * DAY)
    fd, silly = _silly_rename(
        layout, blockio, make_key(0), shared_volume.b if shared_volume.fs == "nfs" else None
    )
    os.utime(silly)  # fresh mtime: must not count as the digest's newest use
    try:
        # stats, from the other client: reported apart, not as blocks or other.
        assert cli.main(["stats", shared_volume.b, "--json", "--threads", "2"]) == 0
        (d,) = json.loads(capsys.readouterr().out)["digests"]
        assert d["blocks"] == 3
        assert d["nfs_silly_renamed"]["count"] == 1
        assert d["other"]["count"] == 0
        # verify ignores it.
        assert cli.main(["verify", shared_volume.b, "--json"]) == 0
        capsys.readouterr()
        # gc from the other client: the digest is 8 days unused, .nfs or not;
        # the .nfs file stays (its holder still reads it), the rest goes.
        status = cli.main(["gc", shared_volume.b, "--json", "--high", "off", "--pid-check", "on"])
        report = json.loads(capsys.readouterr().out)
        assert status == 0, report
        (g,) = report["digests"]
        assert g["removed"], {k: g[k] for k in ("why", "newest", "idle_s") if k in g}
        assert report["scan"]["nfs_silly_renamed"] == 1
        assert not report.get("errors"), report
        leftovers = [
            os.path.join(parent, n)
            for parent, _, names in os.walk(shared_volume.a)
            for n in names
            if not n.startswith(".llmkv-gc")
        ]
        assert [os.path.basename(p) for p in leftovers] == [os.path.basename(silly)], leftovers
        if fd is not None:
            # The holder still reads its bytes: nothing removed it.
            assert os.pread(fd, 64, 0) == pattern(0)[:64]
    finally:
        if fd is not None:
            os.close(fd)
    # Once closed, its client removes it (wherever gc's rename put it); the
    # next gc then removes the trash directory it kept alive.
    (moved,) = leftovers
    if fd is None:
        os.unlink(moved)
    # The client's own unlink of it is asynchronous (an RPC after the close).
    wait_until(lambda: not os.path.exists(moved), f"{moved} to go", deadline_s=30.0)
    assert cli.main(["gc", shared_volume.b, "--json", "--high", "off"]) == 0
    capsys.readouterr()
    assert [n for n in os.listdir(shared_volume.a) if not n.startswith(".llmkv-gc.lock")] == []


def test_a_digest_removed_under_a_reader_gives_it_clean_misses(shared_volume, engines):
    """Client B removes the digest the way gc does (rename aside, delete)
    after replica A looked its blocks up and cached their names: A's loads
    fail as MISSING, never wrong bytes, and new lookups miss."""
    engine_a, layout_a, primary_a = engines(shared_volume.a, n_blocks=6)
    ids = [0, 1, 2]
    store_blocks(engine_a, primary_a, 1, ids, [0, 1, 2])
    keys = [make_key(i) for i in ids]
    assert [settle(engine_a, k, "r") for k in keys] == [True] * 3
    engine_a.forget_request("r")
    rank_b = os.path.join(shared_volume.b, os.path.basename(layout_a.rank_dir))
    trash = trash_path(shared_volume.b, "0" * 12, 0, os.getpid(), time.time_ns())
    os.rename(rank_b, trash)
    problems = Problems()
    assert delete_tree(trash, problems) == (3, True) and not problems

    primary_a[3 * BS : 6 * BS] = b"\0" * (3 * BS)
    assert engine_a.submit_load(2, keys, [3, 4, 5])
    job = wait_jobs(engine_a, [2])[2]
    assert not job.success and sorted(job.failed) == sorted(keys), job
    # A load stops at its first failure (vLLM's built-in does): the rest of
    # the job's blocks are SKIPPED, never read.
    missing = engine_a.counters[Direction.LOAD, Failure.MISSING]
    assert missing >= 1 and missing + engine_a.counters[Direction.LOAD, Failure.SKIPPED] == 3
    assert bytes(primary_a[3 * BS : 6 * BS]) == b"\0" * (3 * BS)
    asked = iter(range(1_000_000))

    def lookups_miss() -> bool:
        request = f"again-{next(asked)}"
        answers = [settle(engine_a, k, request) for k in keys]
        engine_a.forget_request(request)
        return answers == [False] * 3

    # A's client may keep the removed names for a while: GlusterFS's FUSE
    # entry-timeout, NFS's attribute cache (acdirmax 60 s). Loads above were
    # never served; a late hit only costs a miss at load.
    if shared_volume.fs == "gluster":
        wait_until(lookups_miss, "lookups to miss", deadline_s=FUSE_ENTRY_TIMEOUT_S * 5)
    elif shared_volume.fs == "nfs":
        wait_until(lookups_miss, "lookups to miss", deadline_s=90.0)
    assert lookups_miss()


def test_a_replaced_config_is_read_fresh_by_the_other_client(shared_volume, request):
    """Rename over a config.json whose old file client A still holds open:
    NFS client B used to read the old bytes for ~30 s (cached lookup). A
    GlusterFS FUSE client keeps the old name for its entry-timeout (1 s by
    default; opening the directory does not drop it), so there the new bytes
    must come within a few seconds, elsewhere at once."""
    path_a = os.path.join(shared_volume.a, "config.json")
    path_b = os.path.join(shared_volume.b, "config.json")
    dir_a = os.open(shared_volume.a, os.O_RDONLY | os.O_DIRECTORY)
    request.addfinalizer(lambda: os.close(dir_a))
    write_file_atomically_at(dir_a, "config.json", b'{"v": 1}')
    assert read_small_regular_file(path_b)[0] == b'{"v": 1}'  # B caches the name
    with open(path_a, "rb"):  # the old file stays open on A: silly rename
        write_file_atomically_at(dir_a, "config.json", b'{"v": 2}')
        if shared_volume.fs == "gluster":
            wait_until(
                lambda: read_small_regular_file(path_b)[0] == b'{"v": 2}',
                "B to read the new config.json (FUSE entry-timeout)",
                deadline_s=FUSE_ENTRY_TIMEOUT_S * 5,
            )
        assert read_small_regular_file(path_b)[0] == b'{"v": 2}'


def test_a_lease_heartbeat_is_read_fresh_by_the_other_client(shared_volume):
    lease = Lease("elsewhere", 4242, time.time_ns(), "sha256", "f" * 16, 30.0)
    path = write_lease(shared_volume.a, lease)
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    (seen,) = read_leases(shared_volume.b.rstrip("/"))
    assert not seen.is_live()  # B has the file's attributes cached now
    assert refresh_lease(path)
    (seen,) = read_leases(shared_volume.b)
    assert seen.is_live(), time.time() - seen.refreshed
