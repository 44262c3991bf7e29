"""Untrusted volume contents (issue 11, defects 1, 2, 3, 6 and 10): whatever a
neighbour plants on the shared volume -- a symlink at a name we are about to
create, a FIFO or a symlink where a lease or config.json belongs, a lease of
the wrong shape, a directory that merely looks like a digest -- the tier, gc,
stats and verify must neither follow it, nor hang on it, nor die of it, nor
delete it.

Real files and real processes throughout. Command-line runs have a timeout;
an in-process start-up that would hang on a FIFO is given a deadline, after
which the FIFO is opened for writing (that frees the stuck reader) and the
test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from llmkv_fs.engine import prepare_volume
from llmkv_fs.engine.startup.probe import probe_o_direct
from llmkv_fs.engine.upkeep.housekeeping import Housekeeping
from llmkv_fs.engine.upkeep.space import SpaceGuard
from llmkv_fs.layout.blockfile import BlockFileError
from llmkv_fs.layout.names import (
    config_path,
    gc_lock_path,
    lease_dir,
    lease_file_name,
    quarantine_dir,
)
from llmkv_fs.layout.paths import CacheLayout
from llmkv_fs.volume.leases import lease_for, refresh_lease, write_lease
from llmkv_fs.volume.run_config import ensure_run_config
from tests.kits.engine_kit import BS, IDENTITY, make_key, write_blocks
from tests.kits.gc_kit import DAY, age, gc_env, gc_run, key, make_digest, put_block
from tests.kits.names_kit import probe_path
from tests.kits.user_kit import tool_as

HOST = socket.gethostname()
HANG_DEADLINE_S = 15.0
CLI_TIMEOUT_S = 60.0

# Valid JSON, wrong shape or types: each once killed a reader.
MALFORMED_LEASES = {
    "list": [],
    "string": "hello",
    "pid-is-text": {
        "host": HOST,
        "pid": "one",
        "started_ns": 1,
        "hash_algo": "sha256",
        "seed_fingerprint": "f",
        "interval_s": 30,
    },
    "interval-is-text": {
        "host": HOST,
        "pid": 1,
        "started_ns": 1,
        "hash_algo": "sha256",
        "seed_fingerprint": "f",
        "interval_s": "soon",
    },
    "interval-infinite": {
        "host": "elsewhere",
        "pid": 1,
        "started_ns": 1,
        "hash_algo": "sha256",
        "seed_fingerprint": "f",
        "interval_s": float("inf"),
    },
    "missing-fields": {"host": HOST},
}


# -- helpers ---------------------------------------------------------------------------


class Victim:
    """A file outside the cache root that nothing we run may change."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "precious.txt")
        with open(self.path, "wb") as f:
            f.write(b"precious, not a cache file\n" * 10)
        os.utime(self.path, ns=(1_000_000_000, 1_000_000_000))
        self.before = self._state()

    def _state(self):
        st = os.stat(self.path)
        with open(self.path, "rb") as f:
            # ctime: any write, truncate or utime through a link changes it
            # (reading it here changes only the atime).
            return f.read(), st.st_mtime_ns, st.st_ctime_ns, st.st_size

    def assert_untouched(self) -> None:
        assert self._state() == self.before, f"{self.path} was changed through a planted link"


def finishes(fn, fifos=(), deadline_s: float = HANG_DEADLINE_S):
    """fn() on a thread; fails the test if it is still running after the
    deadline (then every FIFO in ``fifos`` is opened for writing once, which
    frees a reader stuck in open())."""
    result: dict = {}

    def body():
        try:
            result["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            result["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(deadline_s)
        pytest.fail(f"still running after {deadline_s}s (hung on a FIFO?)")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def wait_until(predicate, what: str, deadline_s: float = HANG_DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(0.005)


def plant_lease(digest_dir: str, body, name: str | None = None) -> str:
    directory = lease_dir(digest_dir)
    os.makedirs(directory, exist_ok=True)
    path = f"{directory}/{name or lease_file_name(HOST, 1, 1)}"
    with open(path, "w") as f:
        json.dump(body, f)
    return path


def plant_fifo(path: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)
    return path


def cli(*args: str, timeout: float = CLI_TIMEOUT_S, **popen) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-m", "llmkv_fs", *args],
            capture_output=True,
            text=True,
            env=gc_env(),
            timeout=timeout,
            **popen,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"llmkv-fs {' '.join(args)} still running after {timeout}s")


def no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.fixture
def root(tmp_path) -> str:
    path = tmp_path / "kv"
    path.mkdir()
    return str(path)


# -- defect 1: nothing we create follows a symlink or truncates a file ------------------


def test_o_direct_probe_does_not_follow_a_planted_symlink(root, tmp_path):
    victim = Victim(str(tmp_path / "outside"))
    rank_dir = f"{root}/m_0123456789ab_r0"
    os.makedirs(rank_dir)
    os.symlink(victim.path, probe_path(rank_dir, HOST, os.getpid()))
    probe_o_direct(rank_dir)
    victim.assert_untouched()
    assert not os.path.lexists(probe_path(rank_dir, HOST, os.getpid()))


def test_engine_start_with_a_link_at_its_probe_name(engines, root, tmp_path):
    """The probe name carries host and pid, which every lease publishes."""
    victim = Victim(str(tmp_path / "outside"))
    layout = CacheLayout.for_identity(root, IDENTITY)
    prepare_volume(layout)
    os.symlink(victim.path, probe_path(layout.rank_dir, HOST, os.getpid()))
    engines(root, io_mode="auto")
    victim.assert_untouched()


def test_lease_refresh_does_not_stamp_through_a_symlink(root, tmp_path):
    victim = Victim(str(tmp_path / "outside"))
    digest_dir = f"{root}/m_0123456789ab"
    path = write_lease(digest_dir, lease_for("sha256", "f" * 16, 30.0, "", ""))
    os.unlink(path)
    os.symlink(victim.path, path)
    assert refresh_lease(path) is False  # not a lease any more: the caller rewrites it
    victim.assert_untouched()


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_gc_lock_name_taken_by_a_link_or_fifo(root, tmp_path, planted):
    victim = Victim(str(tmp_path / "outside"))
    lock = gc_lock_path(root)
    if planted == "symlink":
        os.symlink(victim.path, lock)
    else:
        os.mkfifo(lock)
    proc = gc_run(root, "--json", timeout=CLI_TIMEOUT_S)
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    victim.assert_untouched()
    assert stat.S_ISREG(os.lstat(lock).st_mode)


def test_quarantine_does_not_move_a_block_through_a_planted_link(root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    layout, blockio = write_blocks(root, [1])
    path = layout.block_path(make_key(1))
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(b"\xff" * 8)  # a bad checksum
    os.symlink(outside, quarantine_dir(layout.rank_dir))
    row = memoryview(bytearray(BS))
    with pytest.raises(BlockFileError):
        blockio.load(make_key(1), row)
    assert os.listdir(outside) == []
    assert not os.path.exists(path)  # moved into a real quarantine directory
    qdir = quarantine_dir(layout.rank_dir)
    assert stat.S_ISDIR(os.lstat(qdir).st_mode) and len(os.listdir(qdir)) == 1


# -- defect 2: malformed leases are reported, never fatal --------------------------------


@pytest.mark.parametrize("body", list(MALFORMED_LEASES.values()), ids=list(MALFORMED_LEASES))
def test_read_lease_dir_reports_malformed_leases(root, body):
    from llmkv_fs.volume.leases import read_lease_dir

    digest_dir = f"{root}/m_0123456789ab"
    bad = plant_lease(digest_dir, body)
    good = write_lease(digest_dir, lease_for("sha256", "f" * 16, 30.0, "", ""))
    found = finishes(lambda: read_lease_dir(digest_dir))
    assert [x.path for x in found.leases] == [good]
    assert [b.path for b in found.bad] == [bad] and found.bad[0].why


def _housekeeping_keeps_working(digest_dir: str, fifos=()) -> None:
    """The lease is refreshed and the space guard re-sampled, repeatedly."""
    guard = SpaceGuard(os.path.dirname(digest_dir), 99.9, 0, 0)
    hk = Housekeeping(guard, digest_dir, lease_interval_s=0.2)
    try:
        hk.set_lease(lease_for("sha256", "f" * 16, 0.2, "", ""))
        wait_until(lambda: hk.lease_path and os.path.exists(hk.lease_path), "the lease")
        for _round in range(2):
            os.utime(hk.lease_path, (1, 1))
            usage = guard.usage
            wait_until(lambda: os.stat(hk.lease_path).st_mtime > 1, "the lease to be refreshed")
            wait_until(lambda u=usage: guard.usage is not u, "the space guard to re-sample")
        assert hk._thread.is_alive()
    finally:
        for fifo in fifos:  # free a thread stuck in open() so stop() can join it
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        hk.stop()


@pytest.mark.parametrize("body", list(MALFORMED_LEASES.values()), ids=list(MALFORMED_LEASES))
def test_housekeeping_survives_a_malformed_lease(root, body):
    digest_dir = f"{root}/m_0123456789ab"
    plant_lease(digest_dir, body)
    _housekeeping_keeps_working(digest_dir)


def test_housekeeping_survives_any_exception(root):
    """No background thread dies of an exception: here the access stamper
    raises something no one expected, every time."""
    digest_dir = f"{root}/m_0123456789ab"
    calls = []

    def broken_stamp() -> int:
        calls.append(1)
        raise RuntimeError("unexpected")

    guard = SpaceGuard(root, 99.9, 0, 0)
    hk = Housekeeping(guard, digest_dir, lease_interval_s=0.2, stamp=broken_stamp)
    try:
        hk.set_lease(lease_for("sha256", "f" * 16, 0.2, "", ""))
        wait_until(lambda: hk.errors >= 3, "three failed stamp rounds")
        wait_until(lambda: hk.lease_path and os.path.exists(hk.lease_path), "the lease")
        assert hk._thread.is_alive() and hk.errors >= 3
    finally:
        hk.stop()


def _old_digest(root: str):
    layouts = make_digest(root, config_age=30 * DAY)
    put_block(layouts[0], key(1), 30 * DAY, 30 * DAY)
    return layouts[0]


@pytest.mark.parametrize("body", list(MALFORMED_LEASES.values()), ids=list(MALFORMED_LEASES))
def test_gc_and_stats_report_a_malformed_lease(root, body):
    layout = _old_digest(root)
    bad = plant_lease(layout.base_path, body)
    proc = gc_run(root, "--json", "--dry-run", timeout=CLI_TIMEOUT_S)
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [b["path"] for b in report["bad_leases"]] == [bad]
    (digest,) = report["digests"]
    assert digest["bad_leases"] == 1

    proc = cli("stats", root, "--json")
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    (digest,) = stats["digests"]
    assert [b["path"] for b in digest["leases"]["bad"]] == [bad]
    assert stats["totals"]["bad_leases"] == 1


# -- defect 3: FIFOs and symlinks where a file is opened by name -------------------------


def test_read_small_regular_file_refuses_specials(root, tmp_path):
    from llmkv_fs.volume.files import read_small_regular_file

    victim = Victim(str(tmp_path / "outside"))
    fifo = plant_fifo(f"{root}/fifo.json")
    link = f"{root}/link.json"
    os.symlink(victim.path, link)
    big = f"{root}/big.json"
    with open(big, "wb") as f:
        f.write(b" " * 2000)
    for path in (fifo, link, big, root):
        with pytest.raises(OSError):
            finishes(lambda p=path: read_small_regular_file(p, 1000), [fifo])
    with open(f"{root}/ok.json", "wb") as f:
        f.write(b"{}")
    data, st = read_small_regular_file(f"{root}/ok.json", 1000)
    assert data == b"{}" and stat.S_ISREG(st.st_mode)


@pytest.mark.parametrize("planted", ["fifo", "symlink"])
def test_engine_start_with_a_special_file_at_config_json(engines, root, tmp_path, planted):
    victim = Victim(str(tmp_path / "outside"))
    layout = CacheLayout.for_identity(root, IDENTITY)
    path = layout.config_path
    os.makedirs(os.path.dirname(path))
    if planted == "fifo":
        plant_fifo(path)
    else:
        # A link to a file holding exactly our config: following it would
        # "match" and leave the link in place.
        with open(victim.path, "wb") as f:
            f.write(json.dumps(layout.run_config, indent=2, sort_keys=True).encode())
        victim.before = victim._state()
        os.symlink(victim.path, path)
    finishes(lambda: engines(root), [path])
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode)
    with open(path, "rb") as f:
        assert json.loads(f.read()) == layout.run_config
    victim.assert_untouched()
    assert finishes(lambda: ensure_run_config(layout)) == "matched"


def _fifo_lease(layout) -> str:
    return plant_fifo(f"{lease_dir(layout.base_path)}/{lease_file_name('node-x', 7, 7)}")


def test_gc_does_not_hang_on_fifos(root):
    layout = _old_digest(root)
    fifo = _fifo_lease(layout)
    other = _old_digest_named(root, "other/model")
    os.unlink(other.config_path)
    plant_fifo(other.config_path)
    proc = gc_run(root, "--json", "--min-age", "0s", timeout=CLI_TIMEOUT_S)
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert fifo in [b["path"] for b in report["bad_leases"]]
    # A digest whose config.json is a FIFO cannot be proven ours: it stays.
    assert os.path.lexists(other.config_path)


def _old_digest_named(root: str, model: str):
    layouts = make_digest(root, model=model, config_age=30 * DAY)
    put_block(layouts[0], key(1), 30 * DAY, 30 * DAY)
    return layouts[0]


def test_stats_does_not_hang_on_fifos_or_follow_lease_links(root, tmp_path):
    layout = _old_digest(root)
    fifo = _fifo_lease(layout)
    # A valid, live lease outside the volume, linked under a lease name.
    outside = tmp_path / "outside"
    outside.mkdir()
    real = write_lease(str(outside), lease_for("sha256", "e" * 16, 30.0, "", ""))
    link = f"{lease_dir(layout.base_path)}/{os.path.basename(real)}"
    os.symlink(real, link)
    other = _old_digest_named(root, "other/model")
    os.unlink(other.config_path)
    plant_fifo(other.config_path)
    proc = cli("stats", root, "--json")
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    by_name = {d["name"]: d for d in stats["digests"]}
    ours = by_name[layout.digest_dir_name]
    assert ours["leases"]["live"] == []
    assert sorted(b["path"] for b in ours["leases"]["bad"]) == sorted([fifo, link])
    assert by_name[other.digest_dir_name]["has_config"] is False


def test_verify_does_not_hang_on_fifos(root):
    layout, _blockio = write_blocks(root, [1, 2])
    _fifo_lease(layout)
    plant_fifo(f"{os.path.dirname(layout.block_path(make_key(3)))}/{'ab' * 16}.bin")
    os.unlink(layout.config_path)
    plant_fifo(layout.config_path)
    proc = cli("verify", root, "--json")
    no_traceback(proc)
    assert proc.returncode in (0, 1), proc.stderr  # 1: the FIFO block is reported bad
    json.loads(proc.stdout)


def test_housekeeping_does_not_hang_on_a_fifo_lease(root):
    digest_dir = f"{root}/m_0123456789ab"
    fifo = plant_fifo(f"{lease_dir(digest_dir)}/{lease_file_name('node-x', 7, 7)}")
    _housekeeping_keeps_working(digest_dir, [fifo])


def test_housekeeping_with_a_symlinked_lease(root, tmp_path):
    victim = Victim(str(tmp_path / "outside"))
    digest_dir = f"{root}/m_0123456789ab"
    os.makedirs(lease_dir(digest_dir))
    os.symlink(victim.path, f"{lease_dir(digest_dir)}/{lease_file_name('node-x', 7, 7)}")
    _housekeeping_keeps_working(digest_dir)
    victim.assert_untouched()


# -- defect 6: the gc lock works for every user of the volume's group --------------------


@pytest.fixture
def shared_root():
    """A root that other uids can reach (pytest's tmp_path is 0700 root's)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run gc as two other users")
    base = tempfile.mkdtemp(prefix="llmkv_fs_group_")
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


GROUP = 4242  # the volume's group (a Kubernetes fsGroup)
USERS = ((4301, 4301), (4302, 4302))  # (uid, primary gid): neither primary is GROUP


def _gc_as(uid: int, gid: int, root: str) -> tuple[int, str]:
    """``llmkv-fs gc ROOT`` as ``uid``/``gid`` with the volume's group as a
    supplementary group and umask 022. Returns (exit status, its output)."""
    status, out, err = tool_as(uid, gid, ["gc", root, "--json"], groups=[GROUP], umask=0o022)
    return status, out + err


@pytest.mark.parametrize("setgid", [True, False], ids=["setgid-root", "plain-root"])
def test_gc_lock_is_shared_by_users_of_one_group(shared_root, setgid):
    root = f"{shared_root}/kv"
    os.mkdir(root)
    os.chown(root, 0, GROUP)
    os.chmod(root, (0o2770 if setgid else 0o770))
    for uid, gid in USERS:
        status, stderr = _gc_as(uid, gid, root)
        assert "Permission denied" not in stderr, (uid, stderr)
        assert status == 0, (uid, stderr)
    st = os.lstat(gc_lock_path(root))
    assert st.st_gid == GROUP and stat.S_IMODE(st.st_mode) & 0o060 == 0o060


# -- defect 10: gc removes only what it can prove is ours --------------------------------


def _look_alikes(root: str) -> list[str]:
    dirs = []
    for name, content in (
        ("photos_0123456789ab", "notes.txt"),
        ("backup_abcdefabcdef_r0", "data.bin"),
        ("empty_00000000aaaa", None),
    ):
        path = f"{root}/{name}"
        os.mkdir(path)
        if content:
            with open(f"{path}/{content}", "w") as f:
                f.write("someone else's\n")
            age(f"{path}/{content}", 400 * DAY)
        age(path, 400 * DAY)
        dirs.append(path)
    # A config.json that does not hash to the directory's digest.
    liar = f"{root}/liar_0123456789ab"
    os.mkdir(liar)
    with open(config_path(liar), "w") as f:
        json.dump({"model_name": "x"}, f)
    age(config_path(liar), 400 * DAY)
    age(liar, 400 * DAY)
    return [*dirs, liar]


@pytest.mark.parametrize("args", [(), ("--min-age", "0s")], ids=["defaults", "min-age-0"])
def test_gc_leaves_look_alike_digest_dirs(root, args):
    look_alikes = _look_alikes(root)
    ours = _old_digest(root)
    proc = gc_run(root, "--json", *args, timeout=CLI_TIMEOUT_S)
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    for path in look_alikes:
        assert os.path.isdir(path), f"gc deleted {path}, which is not provably ours"
    by_name = {d["name"]: d for d in report["digests"]}
    for name in ("photos_0123456789ab", "backup_abcdefabcdef", "liar_0123456789ab"):
        assert by_name[name]["removed"] is False
        assert "not provably" in by_name[name]["why"], by_name[name]
    # Our own orphan still goes (30 days idle > 7 days).
    assert not os.path.exists(ours.base_path) and not os.path.exists(ours.rank_dir)


def test_rank_dirs_of_only_our_names_are_ours(root):
    """A digest whose config directory is gone (a gc interrupted between its
    renames) is still ours when its rank directories hold only our names."""
    layout = _old_digest(root)
    shutil.rmtree(layout.base_path)
    proc = gc_run(root, "--json", timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(layout.rank_dir)


def test_gc_trash_never_deletes_through_a_link(root, tmp_path):
    """gc's trash lies in the root, which anyone who can write the volume
    can change: a link at a trash name (or below it) is removed itself, the
    directory it points to is untouched."""
    from llmkv_fs.layout.names import trash_path

    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "keep.txt").write_text("mine")
    (outside / "deep" / "keep.txt").write_text("mine")
    top_link = trash_path(root, "0123456789ab", None, 1, 1)
    os.symlink(outside, top_link)
    inner = trash_path(root, "0123456789ab", 0, 1, 2)
    os.makedirs(f"{inner}/abc")
    os.symlink(outside, f"{inner}/abc/def")
    proc = gc_run(root, "--json", timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(outside)) == ["deep", "keep.txt"]
    assert os.listdir(outside / "deep") == ["keep.txt"]
    # The link in the root is reported and left (gc never acts on a root
    # symlink); the real trash directory is gone, its inner link unlinked.
    assert top_link in json.loads(proc.stdout)["symlinks"]
    assert not os.path.lexists(inner)
    # And delete_tree itself, handed a link, unlinks the link only.
    from llmkv_fs.ops.gc.actions import delete_tree
    from llmkv_fs.ops.problems import Problems

    problems = Problems()
    assert delete_tree(top_link, problems) == (1, True) and not problems
    assert not os.path.lexists(top_link) and os.listdir(outside / "deep") == ["keep.txt"]
