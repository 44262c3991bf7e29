"""Issue 21: writes and moves outside the root. A directory inside the cache
tree -- ``<hhh>``, ``<hh>_g<g>``, the rank directory, the digest directory,
``leases`` -- replaced by a symlink to a directory elsewhere on the same
filesystem must cost a miss or a refused store, never a directory, file,
rename, unlink or stamp outside the root (volume.beneath resolves every name
component by component from the root's descriptor, without following a
link). Through the engine with I/O threads and with worker processes, on a
real tmpfs and on the disk under tmp_path (ext4); prepare_volume and the
leases directly. And since descriptors are involved: directories gc removes
between two stores are made again, and no descriptor outlives its user.

Real files, real filesystems, real worker processes; no sleeps.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import mmap
import os
import stat
import time

import pytest

from llmkv_fs.config import TierSettings
from llmkv_fs.engine import (
    Direction,
    Failure,
    FsEngine,
    LookupAnswer,
    Outcome,
    VolumeError,
    prepare_volume,
)
from llmkv_fs.engine.startup.io_setup import choose_o_direct
from llmkv_fs.layout.blockfile import TRAILER_SIZE
from llmkv_fs.layout.names import lease_dir, quarantine_dir, trash_path
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.ops.gc.actions import delete_tree
from llmkv_fs.volume import beneath
from llmkv_fs.volume.beneath import DIR_FLAGS, Beneath, LinkInTree, MountInTree, open_beneath
from llmkv_fs.volume.files import SHARED_FS_ATTEMPTS
from llmkv_fs.volume.leases import lease_for, read_leases, refresh_lease, remove_lease, write_lease
from llmkv_fs.volume.pinned_root import PinnedRoot
from tests.kits.engine_kit import (
    BS,
    IDENTITY,
    fill,
    inside,
    make_key,
    pattern,
    row,
    settle,
    wait_jobs,
    write_blocks,
)

MODES = [0, 2]  # io_workers: I/O threads, worker processes


def link_failures(engine, direction: Direction) -> int:
    # Looked up by value: on code without the reason this fails after the
    # checks that nothing was written outside.
    return engine.counters[direction, Failure("link_in_tree")]


def key_at(fanout: str, i: int) -> bytes:
    """A key whose block lives under ``<fanout[:3]>/<fanout[3:5]>_g0``."""
    digest = hashlib.sha256(f"beneath-{i}".encode()).hexdigest()
    return bytes.fromhex(fanout + digest[len(fanout) :]) + (0).to_bytes(4, "big")


class Tree:
    """A directory outside the root that nothing the tier does may change:
    every entry's name, size, mtime and ctime (a create, unlink, rename or
    utime anywhere in it changes one of them)."""

    def __init__(self, path: str):
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.before = self.state()

    def state(self) -> dict[str, tuple[int, int, int]]:
        found = {}
        for where, dirs, files in os.walk(self.path):
            for name in [".", *dirs, *files]:
                full = os.path.normpath(os.path.join(where, name))
                st = os.lstat(full)
                at = os.path.relpath(full, self.path)
                found[at] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        return found

    def assert_untouched(self) -> None:
        assert self.state() == self.before, f"written outside the root, in {self.path}"


@pytest.fixture(params=["tmpfs", "ext4"])
def base(request, tmp_path, mount_tmpfs):
    """A directory on a real tmpfs mount or on the disk under tmp_path; the
    root and the "outside" directory both live in it (one filesystem, so a
    rename out of the root would succeed if it were ever tried)."""
    return mount_tmpfs("64m") if request.param == "tmpfs" else str(tmp_path)


@pytest.fixture
def start(engines, base):
    def make(mode: int, n_blocks: int = 8):
        engine, layout, primary = engines(f"{base}/kv", n_blocks, io_workers=mode)
        assert engine.io_workers == mode  # worker processes really in use
        return engine, layout, primary

    return make


def store(engine, primary, job_id: int, key: bytes, chunk: int = 0, data: bytes | None = None):
    fill(primary, chunk, pattern(job_id) if data is None else data)
    assert engine.submit_store(job_id, [key], [chunk])
    return wait_jobs(engine, [job_id])[job_id]


def load(engine, job_id: int, key: bytes, chunk: int):
    assert engine.submit_load(job_id, [key], [chunk])
    return wait_jobs(engine, [job_id])[job_id]


def swap_for_link(path: str, elsewhere: str) -> None:
    """Move the directory ``path`` to ``elsewhere`` and leave a link to it."""
    os.rename(path, elsewhere)
    os.symlink(elsewhere, path)


# -- fan-out directories ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", ["hhh", "hh_g"])
def test_store_through_a_symlinked_fanout_dir_writes_nothing_outside(start, base, mode, level):
    engine, layout, primary = start(mode)
    key = key_at("abcde", 1)
    leaf = os.path.dirname(layout.block_path(key))
    linked = leaf if level == "hh_g" else os.path.dirname(leaf)
    os.makedirs(os.path.dirname(linked), exist_ok=True)
    outside = Tree(f"{base}/outside")
    os.symlink(outside.path, linked)

    job = store(engine, primary, 1, key)
    outside.assert_untouched()
    assert not job.success
    assert os.path.islink(linked)  # left where it was planted, not followed
    assert link_failures(engine, Direction.STORE) == 1
    assert engine.counters[Outcome.WRITTEN] == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_block_behind_a_symlinked_dir_is_a_miss_and_never_loaded(start, base, mode):
    engine, layout, primary = start(mode)
    key = key_at("abcde", 2)
    assert store(engine, primary, 1, key).success
    hhh = os.path.dirname(os.path.dirname(layout.block_path(key)))
    swap_for_link(hhh, f"{base}/outside")  # a valid block, now reached through a link
    outside = Tree(f"{base}/outside")

    assert settle(engine, key, "r1") is False
    assert engine.counters[LookupAnswer.HIT] == 0
    job = load(engine, 2, key, 1)
    assert not job.success and row(primary, 1) == bytes(BS)
    assert link_failures(engine, Direction.LOAD) == 1
    outside.assert_untouched()


@pytest.mark.parametrize("mode", MODES)
def test_a_damaged_block_behind_a_symlinked_dir_is_not_moved_out(start, base, mode):
    engine, layout, primary = start(mode)
    key = key_at("abcde", 3)
    assert store(engine, primary, 1, key).success
    path = layout.block_path(key)
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)  # a bad checksum: a load would quarantine it
    swap_for_link(os.path.dirname(os.path.dirname(path)), f"{base}/outside")
    outside = Tree(f"{base}/outside")

    job = load(engine, 2, key, 1)
    outside.assert_untouched()  # the bad file was not renamed out of it
    assert not job.success
    assert not os.path.exists(quarantine_dir(layout.rank_dir)) or not os.listdir(
        quarantine_dir(layout.rank_dir)
    )
    assert link_failures(engine, Direction.LOAD) == 1


# -- the rank directory --------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_symlinked_rank_dir_refuses_start_up(engines, base, mode):
    root = f"{base}/kv"
    layout = CacheLayout.for_identity(root, IDENTITY)
    prepare_volume(layout)  # config.json in place: only the rank directory is wrong
    os.rmdir(layout.rank_dir)
    outside = Tree(f"{base}/outside")
    os.symlink(outside.path, layout.rank_dir)

    with pytest.raises(VolumeError, match="symlink") as info:
        engines(root, io_workers=mode, io_mode="auto")
    outside.assert_untouched()  # no O_DIRECT probe written (and removed) there
    assert layout.rank_dir in str(info.value)


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_dir_swapped_for_a_link_while_running(start, base, mode):
    engine, layout, primary = start(mode)
    old = key_at("12345", 1)
    assert store(engine, primary, 1, old).success
    swap_for_link(layout.rank_dir, f"{base}/outside")
    outside = Tree(f"{base}/outside")

    assert not store(engine, primary, 2, key_at("12345", 2), 1).success
    assert not load(engine, 3, old, 2).success
    assert settle(engine, old, "r1") is False
    outside.assert_untouched()
    assert link_failures(engine, Direction.STORE) == 1
    assert link_failures(engine, Direction.LOAD) == 1


def test_the_o_direct_probe_does_not_follow_a_symlinked_rank_dir(base):
    root = f"{base}/kv"
    os.makedirs(root)
    outside = Tree(f"{base}/outside")
    rank_dir = f"{root}/m_0123456789ab_r0"
    os.symlink(outside.path, rank_dir)
    aligned = mmap.mmap(-1, 4 * BS)
    # The probe would create and remove a file there: the directory's mtime
    # and ctime tell.
    assert choose_o_direct("auto", memoryview(aligned), BS, rank_dir) is False
    outside.assert_untouched()


# -- the digest directory: config.json and leases -----------------------------------------


def test_prepare_volume_refuses_a_symlinked_digest_dir(base):
    root = f"{base}/kv"
    layout = CacheLayout.for_identity(root, IDENTITY)
    os.makedirs(root)
    outside = Tree(f"{base}/outside")
    os.symlink(outside.path, layout.base_path)
    with pytest.raises(VolumeError, match="symlink"):
        prepare_volume(layout)
    outside.assert_untouched()  # no config.json, no temp file, no directory


def _lease_setup(base):
    root = f"{base}/kv"
    layout = CacheLayout.for_identity(root, IDENTITY)
    prepare_volume(layout)
    return PinnedRoot.pin(root), layout.base_path, lease_for("sha256", "f" * 16, 30.0, "", "")


def test_a_lease_is_never_written_through_a_symlinked_digest_dir(base):
    pinned, digest_dir, lease = _lease_setup(base)
    swap_for_link(digest_dir, f"{base}/outside")
    outside = Tree(f"{base}/outside")
    with pytest.raises(OSError):
        write_lease(digest_dir, lease, root=pinned)
    with pytest.raises(OSError):
        write_lease(digest_dir, lease)  # without a pin: the digest's parent is the root
    outside.assert_untouched()
    assert read_leases(digest_dir, pinned) == []


def test_a_lease_behind_a_symlinked_leases_dir_is_neither_stamped_nor_removed(base):
    pinned, digest_dir, lease = _lease_setup(base)
    path = write_lease(digest_dir, lease, root=pinned)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    swap_for_link(lease_dir(digest_dir), f"{base}/outside")
    outside = Tree(f"{base}/outside")
    assert refresh_lease(path) is False  # the caller rewrites it
    assert remove_lease(path) is False  # left to go stale
    outside.assert_untouched()
    assert refresh_lease(path, pinned) is False
    assert remove_lease(path, pinned) is False
    outside.assert_untouched()


# -- access stamps -----------------------------------------------------------------------


def test_access_stamps_never_go_through_a_symlinked_dir(base):
    root = f"{base}/kv"
    layout, blockio = write_blocks(root, [1])
    key = make_key(1)
    buf = memoryview(bytearray(BS))
    assert blockio.load(key, buf) is Outcome.VERIFIED
    assert blockio.has_queued_stamps()
    path = layout.block_path(key)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    swap_for_link(os.path.dirname(os.path.dirname(path)), f"{base}/outside")
    outside = Tree(f"{base}/outside")
    assert blockio.apply_access_stamps() == 0
    outside.assert_untouched()


def test_quarantine_by_path_never_moves_a_file_out_of_a_linked_dir(base):
    layout, blockio = write_blocks(f"{base}/kv", [1, 2])
    linked, kept = layout.block_path(make_key(1)), layout.block_path(make_key(2))
    assert os.path.dirname(os.path.dirname(linked)) != os.path.dirname(os.path.dirname(kept))
    swap_for_link(os.path.dirname(os.path.dirname(linked)), f"{base}/outside")
    outside = Tree(f"{base}/outside")
    with pytest.raises(OSError):
        blockio.quarantine(linked, "bad-checksum")
    outside.assert_untouched()
    moved = blockio.quarantine(kept, "bad-checksum")  # a real one still goes
    assert moved is not None and moved.startswith(quarantine_dir(layout.rank_dir) + "/")
    assert os.path.isfile(moved) and not os.path.lexists(kept)


# -- directories removed under a running tier (the descriptors) ----------------------------


@pytest.mark.parametrize("mode", MODES)
def test_stores_land_after_gc_prunes_their_fanout_dirs(start, mode):
    engine, layout, primary = start(mode)
    first, second = key_at("77777", 1), key_at("77777", 2)
    assert store(engine, primary, 1, first).success
    # gc: evict the block, then rmdir the emptied directories bottom-up.
    path = layout.block_path(first)
    os.unlink(path)
    os.rmdir(os.path.dirname(path))
    os.rmdir(os.path.dirname(os.path.dirname(path)))

    job = store(engine, primary, 2, second, 1, pattern("second"))
    assert job.success and engine.counters[Outcome.WRITTEN] == 2
    with open(layout.block_path(second), "rb") as f:
        assert f.read(BS) == pattern("second")
    assert os.path.getsize(layout.block_path(second)) == BS + TRAILER_SIZE


@pytest.mark.parametrize("mode", MODES)
def test_stores_land_after_gc_removes_the_rank_dir(start, mode):
    engine, layout, primary = start(mode)
    first, second = key_at("88888", 1), key_at("88888", 2)
    assert store(engine, primary, 1, first).success
    # gc removing a digest: the rank directory renamed to a trash name in
    # the root, then deleted there. A store must not land in the trash.
    trash = trash_path(layout.root_dir, layout.digest, layout.rank, os.getpid(), time.time_ns())
    os.rename(layout.rank_dir, trash)
    errors: list[str] = []
    assert delete_tree(trash, errors) == (1, True) and errors == []

    assert store(engine, primary, 2, second, 1, pattern("again")).success
    with open(layout.block_path(second), "rb") as f:
        assert f.read(BS) == pattern("again")
    assert not os.path.exists(trash)
    load_job = load(engine, 3, second, 2)
    assert load_job.success and row(primary, 2) == pattern("again")


# -- descriptors do not leak ---------------------------------------------------------------


def _dir_fds_below(pid: int | str, root: str) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target == root or target.startswith(root + "/"):
            count += 1
    return count


@pytest.mark.parametrize("mode", MODES)
def test_no_descriptor_outlives_its_user(base, mode):
    root = f"{base}/kv"
    primary = mmap.mmap(-1, 8 * BS)
    settings = TierSettings(
        root_dir=root, io_workers=mode, n_read_threads=2, n_write_threads=2, lookup_threads=2
    )
    engine = FsEngine(settings, CacheLayout.for_identity(root, IDENTITY), primary, BS)
    assert engine.io_workers == mode
    root = os.path.realpath(root)
    keys = [key_at(f"{i:05x}", i) for i in range(24)]  # 24 fan-out directories
    try:
        for i, key in enumerate(keys):
            assert store(engine, primary, 100 + i, key, i % 8).success
        for i, key in enumerate(keys):
            assert load(engine, 200 + i, key, i % 8).success
            assert settle(engine, key, f"r{i}") is True
        # One (the root's) per thread that used it, or per worker process,
        # whatever the number of blocks and directories.
        threads = 2 + 2 + 1 + 2 + 1  # read, write, lookup, its pool, housekeeping
        assert _dir_fds_below("self", root) <= (threads if mode == 0 else 4)
        for pid in inside(engine).executor.worker_pids() if mode else ():
            assert _dir_fds_below(pid, root) <= 1
    finally:
        engine.shutdown()
    # Every thread joined took its descriptor along; the owner thread (it
    # applied the last stamps at shutdown) holds one until the engine goes.
    assert _dir_fds_below("self", root) <= 1
    del engine
    gc.collect()
    assert _dir_fds_below("self", root) == 0


# -- the creating walk's bind-mount check (a second openat2 call) ----------------------------


class Openat2Answers:
    """``open_beneath`` as beneath.py calls it, counting the calls: those
    numbered in ``fail`` (from 1) answer ``code`` (after ``before(path)``,
    if given), the others are the real call. A fresh directory's creating
    walk makes no call first, so call 1 is the check after it."""

    def __init__(self, code: int, fail, before=None):
        self.code, self.fail, self.before = code, set(fail), before
        self.calls = 0

    def __call__(self, dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
        self.calls += 1
        if self.calls in self.fail:
            if self.before is not None:
                self.before(path)
            raise OSError(self.code, os.strerror(self.code), path)
        return open_beneath(dir_fd, path, flags, mode)


def _open_fds(below: Beneath) -> list[str]:
    """What this process's descriptors of the root and below it point at,
    sorted (a count of all descriptors would race whatever other threads of
    the process open; the numbers themselves may change, as when an ESTALE
    makes the walk open its root again, so the targets are compared)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if target == below.path or target.startswith(below.path + "/"):
            found.append(target)
    return sorted(found)


@pytest.fixture
def below(tmp_path):
    """A Beneath on a fresh root, its root descriptor already open (so a
    count of this process's descriptors sees only what a call leaves)."""
    made = Beneath(str(tmp_path / "kv"))
    os.mkdir(made.path)
    made.one_call = True
    made.root_fd()
    return made


def _is_the_dir(fd: int, path: str) -> None:
    st = os.fstat(fd)  # EBADF for a descriptor closed and handed out
    assert stat.S_ISDIR(st.st_mode)
    assert (st.st_dev, st.st_ino) == (os.stat(path).st_dev, os.stat(path).st_ino)


@pytest.mark.parametrize(
    ("code", "calls"),
    [(errno.EAGAIN, 3), (errno.ENOSYS, 1), (errno.EPERM, 1)],
    ids=["EAGAIN", "ENOSYS", "EPERM"],
)
def test_a_check_openat2_cannot_settle_keeps_the_walks_descriptor(below, monkeypatch, code, calls):
    answers = Openat2Answers(code, range(1, 100))
    monkeypatch.setattr(beneath, "open_beneath", answers)
    before = _open_fds(below)
    fd = below.open_dir("a/b/c", create=True)
    try:
        _is_the_dir(fd, f"{below.path}/a/b/c")
        assert answers.calls == calls  # EAGAIN is asked again, the others once
    finally:
        os.close(fd)
    assert _open_fds(below) == before


def test_an_eagain_once_is_asked_again(below, monkeypatch):
    answers = Openat2Answers(errno.EAGAIN, [1])
    monkeypatch.setattr(beneath, "open_beneath", answers)
    fd = below.open_dir("a/b", create=True)
    try:
        _is_the_dir(fd, f"{below.path}/a/b")
        assert answers.calls == 2
    finally:
        os.close(fd)


@pytest.mark.parametrize("code", [errno.ENOENT, errno.ESTALE], ids=["ENOENT", "ESTALE"])
def test_a_dir_removed_before_the_check_is_made_again(below, monkeypatch, code):
    # gc removes the directory the walk has just made, before the check.
    answers = Openat2Answers(code, [1], before=lambda rel: os.rmdir(f"{below.path}/{rel}"))
    monkeypatch.setattr(beneath, "open_beneath", answers)
    before = _open_fds(below)
    fd = below.open_dir("a/b/c", create=True)
    try:
        _is_the_dir(fd, f"{below.path}/a/b/c")
        assert answers.calls == 2  # the walk again, and its check
    finally:
        os.close(fd)
    assert _open_fds(below) == before


def test_a_dir_removed_before_every_check_fails_cleanly(below, monkeypatch):
    answers = Openat2Answers(errno.ENOENT, range(1, 100))
    monkeypatch.setattr(beneath, "open_beneath", answers)
    before = _open_fds(below)
    with pytest.raises(FileNotFoundError) as raised:
        below.open_dir("a/b", create=True)
    assert raised.value.filename == f"{below.path}/a/b"
    assert answers.calls == SHARED_FS_ATTEMPTS
    assert _open_fds(below) == before


@pytest.mark.parametrize(
    ("code", "error"),
    [(errno.ELOOP, LinkInTree), (errno.EXDEV, MountInTree)],
    ids=["ELOOP", "EXDEV"],
)
def test_a_link_or_mount_seen_by_the_check_closes_the_walks_descriptor(
    below, monkeypatch, code, error
):
    monkeypatch.setattr(beneath, "open_beneath", Openat2Answers(code, range(1, 100)))
    before = _open_fds(below)
    with pytest.raises(error) as raised:
        below.open_dir("a/b", create=True)
    assert raised.value.filename == f"{below.path}/a/b"
    assert _open_fds(below) == before


def test_stores_land_where_openat2_answers_eagain_to_the_check(tmp_path, monkeypatch):
    """Threads only: the answer is made in this process (worker processes
    are fresh interpreters and call the real openat2); the Python byte path
    (compiled_io off), whose walk is under test (the compiled one opens beneath the root in C
    and leaves what it cannot settle to this walk)."""
    dir_opens = Openat2Answers(errno.EAGAIN, range(1, 10**6))

    def answers(dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
        if flags == DIR_FLAGS:  # the check, and a known directory's one-call open
            return dir_opens(dir_fd, path, flags, mode)
        return open_beneath(dir_fd, path, flags, mode)

    monkeypatch.setattr(beneath, "open_beneath", answers)
    root = str(tmp_path / "kv")
    primary = mmap.mmap(-1, 4 * BS)
    engine = FsEngine(  # start-up makes the rank directory: a creating walk
        TierSettings(root_dir=root, io_workers=0, compiled_io=False),
        CacheLayout.for_identity(root, IDENTITY),
        primary,
        BS,
    )
    try:
        layout = CacheLayout.for_identity(root, IDENTITY)
        keys = [key_at("12345", 1), key_at("12345", 2), key_at("abcde", 3)]
        for i, key in enumerate(keys):
            assert store(engine, primary, 1 + i, key, i, pattern(f"eagain-{i}")).success
            with open(layout.block_path(key), "rb") as f:
                assert f.read(BS) == pattern(f"eagain-{i}")
        assert dir_opens.calls >= 3 * len(keys)  # every check answered EAGAIN
        for i, key in enumerate(keys):
            assert load(engine, 10 + i, key, 3).success and row(primary, 3) == pattern(
                f"eagain-{i}"
            )
    finally:
        engine.shutdown()
