"""Explicit access stamps on load (for LRU eviction under relatime/noatime)
and exact file/directory modes whatever the process umask.

Stamps are checked on a tmpfs mounted ``noatime``: the kernel then never
touches atime by itself, so any change is ours. Modes are checked in a
subprocess, because the umask is read once, when volume/files.py is imported.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from llmkv_fs.config import TierConfigError, TierSettings
from llmkv_fs.engine import Outcome
from llmkv_fs.engine.block import stamps
from llmkv_fs.layout.blockfile import ACCESS_STAMP_INTERVAL_S, TRAILER_SIZE
from tests.kits.clock_kit import JUST_BEFORE_S, ManualClock
from tests.kits.engine_kit import BS, make_key, pattern, row, store_blocks, wait_jobs, wait_until

OLD_NS = 1_000_000_000 * 10**9  # September 2001


@pytest.fixture
def noatime_tmpfs(mount_tmpfs):
    return mount_tmpfs("16m", "noatime")


def fs_now_ns(mount: str) -> int:
    """'Now' by the clock the filesystem stamps with (the kernel's coarse
    clock may lag time.time_ns() by a tick)."""
    probe = f"{mount}/.clock"
    with open(probe, "ab"):
        pass
    os.utime(probe)
    return os.stat(probe).st_mtime_ns


def make_old(path: str) -> None:
    os.utime(path, ns=(OLD_NS, OLD_NS))


def load(engine, job_id: int, key: bytes, chunk: int):
    assert engine.submit_load(job_id, [key], [chunk])
    job = wait_jobs(engine, [job_id])[job_id]
    assert job.success, job
    return job


def wait_stamped(path: str, not_before_ns: int) -> None:
    """The stamp may be applied off the load path (by the housekeeping
    thread, about once a second): poll for it."""
    wait_until(
        lambda: os.stat(path).st_atime_ns >= not_before_ns,
        f"the access stamp on {os.path.basename(path)}",
        deadline_s=10.0,
    )


# -- access stamps --------------------------------------------------------------------------


def test_the_kernel_does_not_stamp_reads_on_this_mount(noatime_tmpfs):
    # The premise of the tests below: a plain read leaves atime alone here.
    path = f"{noatime_tmpfs}/probe"
    with open(path, "wb") as f:
        f.write(b"x" * 4096)
    make_old(path)
    with open(path, "rb") as f:
        assert f.read() == b"x" * 4096
    assert os.stat(path).st_atime_ns == OLD_NS


def test_load_stamps_access_once_per_interval(noatime_tmpfs, engines):
    assert ACCESS_STAMP_INTERVAL_S == 60.0
    engine, layout, primary = engines(noatime_tmpfs, n_blocks=4)
    store_blocks(engine, primary, 1, ["a", "b", "c"], [0, 1, 2])
    path_a, path_b, path_c = (layout.block_path(make_key(i)) for i in "abc")
    for path in (path_a, path_b, path_c):
        make_old(path)

    before = fs_now_ns(noatime_tmpfs)
    load(engine, 2, make_key("a"), 3)
    assert row(primary, 3) == pattern("a")
    wait_stamped(path_a, before)
    assert os.stat(path_b).st_atime_ns == OLD_NS  # only the file that was loaded

    # Within the interval: no second stamp (no metadata write per load). The
    # first load of another file, queued after it, shows when stamps landed.
    make_old(path_a)
    load(engine, 3, make_key("a"), 3)
    before = fs_now_ns(noatime_tmpfs)
    load(engine, 4, make_key("b"), 3)
    wait_stamped(path_b, before)
    assert os.stat(path_a).st_atime_ns == OLD_NS
    assert os.stat(path_c).st_atime_ns == OLD_NS
    assert os.path.getsize(path_a) == BS + TRAILER_SIZE  # stamping did not touch the content


@pytest.mark.threads_only(
    "moves the stamp interval's clock by patching the module in this process; a worker runs "
    "the same BlockIO stamping on the real clock, and the once-per-interval half "
    "(test_load_stamps_access_once_per_interval) runs in both modes"
)
def test_stamp_is_renewed_after_the_interval(noatime_tmpfs, engines, monkeypatch):
    clock = ManualClock().install(monkeypatch, stamps)  # the interval passes when the test says
    engine, layout, primary = engines(noatime_tmpfs, n_blocks=4)
    store_blocks(engine, primary, 1, ["r", "s"], [0, 1])
    path = layout.block_path(make_key("r"))
    make_old(path)
    before = fs_now_ns(noatime_tmpfs)
    load(engine, 2, make_key("r"), 2)
    wait_stamped(path, before)

    # Just before the interval ends: no stamp. The first load of another
    # file, queued after it, shows when stamps landed.
    make_old(path)
    clock.advance(ACCESS_STAMP_INTERVAL_S - JUST_BEFORE_S)
    load(engine, 3, make_key("r"), 2)
    before = fs_now_ns(noatime_tmpfs)
    load(engine, 4, make_key("s"), 3)
    wait_stamped(layout.block_path(make_key("s")), before)
    assert os.stat(path).st_atime_ns == OLD_NS

    # Once the interval has passed, the next load stamps again.
    clock.advance(JUST_BEFORE_S)
    before = fs_now_ns(noatime_tmpfs)
    load(engine, 5, make_key("r"), 2)
    wait_stamped(path, before)


def test_trailerless_file_is_stamped_when_loaded(noatime_tmpfs, engines):
    engine, layout, primary = engines(noatime_tmpfs, n_blocks=2, accept_trailerless=True)
    key = make_key("vllm")
    path = layout.block_path(key)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:  # what vLLM's built-in fs tier writes
        f.write(pattern("vllm"))
    make_old(path)
    before = fs_now_ns(noatime_tmpfs)
    load(engine, 1, key, 1)
    assert engine.counters[Outcome.UNVERIFIED] == 1
    assert row(primary, 1) == pattern("vllm")
    wait_stamped(path, before)
    assert os.path.getsize(path) == BS  # stamping did not touch the content


def test_failed_load_does_not_stamp(noatime_tmpfs, engines):
    engine, layout, primary = engines(noatime_tmpfs, n_blocks=4)
    store_blocks(engine, primary, 1, ["good"], [0])
    good = layout.block_path(make_key("good"))
    key = make_key("bad")
    path = layout.block_path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(pattern("bad")[: BS // 2])  # truncated
    make_old(path)
    make_old(good)
    inode = os.stat(path).st_ino
    assert engine.submit_load(2, [key], [1])
    assert not wait_jobs(engine, [2])[2].success
    before = fs_now_ns(noatime_tmpfs)
    load(engine, 3, make_key("good"), 2)  # queued after the bad one would have been
    wait_stamped(good, before)
    (moved,) = [os.path.join(layout.quarantine_dir, n) for n in os.listdir(layout.quarantine_dir)]
    st = os.stat(moved)
    assert st.st_ino == inode and st.st_atime_ns == OLD_NS


# -- modes ----------------------------------------------------------------------------------

# Runs in a fresh interpreter: the umask is set before llmkv_fs is imported.
_MODES_SCRIPT = textwrap.dedent("""
    import json, mmap, os, sys, time
    args = json.loads(sys.argv[1])
    os.umask(args["umask"])
    from llmkv_fs.config import TierSettings
    from llmkv_fs.engine import FsEngine
    from llmkv_fs.volume import files
    from llmkv_fs.volume.leases import lease_for, read_leases
    from llmkv_fs.layout.paths import CacheLayout, RunIdentity

    BS = args["block_size"]
    settings = TierSettings.from_mapping({
        "root_dir": args["root"], "n_read_threads": 1, "n_write_threads": 1,
        "lookup_threads": 1, "lease_interval_s": 5, **args["modes"]})
    layout = CacheLayout.for_identity(args["root"], RunIdentity(
        model_name="m/x", dtype="bfloat16", tokens_per_hash=16, blocks_per_file=1,
        kv_cache_groups=((16, ("l0",)),)))
    primary = mmap.mmap(-1, 4 * BS)
    engine = FsEngine(settings, layout, primary, BS)

    def run(job_id, is_load, keys, chunks):
        submit = engine.submit_load if is_load else engine.submit_store
        assert submit(job_id, keys, chunks)
        deadline = time.monotonic() + 20
        while True:
            done = [j for j in engine.take_finished() if j.job_id == job_id]
            if done:
                return done[0]
            assert time.monotonic() < deadline, "job did not finish"
            time.sleep(0.002)

    keys = [bytes([i]) * 32 + b"\\0\\0\\0\\0" for i in (1, 2, 3)]  # three <hhh> dirs
    assert run(1, False, keys, [0, 1, 2]).success
    os.truncate(layout.block_path(keys[2]), 100)  # corrupt one: the load quarantines it
    assert not run(2, True, keys[2:], [3]).success
    engine.set_lease(lease_for("sha256", "f", 5, "v", "l"))
    deadline = time.monotonic() + 20
    while not read_leases(layout.base_path):
        assert time.monotonic() < deadline, "no lease written"
        time.sleep(0.002)
    (lease,) = read_leases(layout.base_path)
    lease_mode = os.stat(lease.path).st_mode & 0o7777
    engine.shutdown()
    print(json.dumps({"umask": files.PROCESS_UMASK, "lease_mode": lease_mode,
                      "rank_dir": layout.rank_dir, "base": layout.base_path}))
""")


def run_modes_script(root: str, umask: int, modes: dict) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _MODES_SCRIPT,
            json.dumps({"root": root, "umask": umask, "modes": modes, "block_size": BS}),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("umask", "modes", "file_mode", "dir_mode"),
    [
        (0o077, {}, 0o640, 0o770),
        (0o022, {}, 0o640, 0o770),
        (0o000, {}, 0o640, 0o770),
        (0o022, {"file_mode": "0600", "dir_mode": "0700"}, 0o600, 0o700),
        (0o077, {"file_mode": "0660", "dir_mode": "2770"}, 0o660, 0o2770),
    ],
)
def test_modes_are_exact_whatever_the_umask(tmp_path, umask, modes, file_mode, dir_mode):
    root = tmp_path / "kv"
    root.mkdir()
    os.chmod(root, 0o755)
    out = run_modes_script(str(root), umask, modes)
    assert out["umask"] == umask  # the subprocess really ran under it
    assert out["lease_mode"] == file_mode

    dirs, regular = [], []
    for parent, dirnames, names in os.walk(root):
        dirs += [os.path.join(parent, d) for d in dirnames]
        regular += [os.path.join(parent, n) for n in names]
    rank, base = out["rank_dir"], out["base"]
    must_exist = {base, f"{base}/leases", rank, f"{rank}/.quarantine"}
    assert must_exist <= set(dirs)
    hashed = [d for d in dirs if d.startswith(rank + "/") and "/.quarantine" not in d]
    assert len(hashed) == 6  # three <hhh> and three <hh>_g0
    for d in dirs:
        assert stat.S_IMODE(os.stat(d).st_mode) == dir_mode, f"{d}: {oct(os.stat(d).st_mode)}"
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o755  # the root is not ours to change

    names = sorted(os.path.basename(f) for f in regular)
    assert len(regular) == 4, names  # config.json, two blocks, one quarantined block
    assert "config.json" in names
    assert not [n for n in names if n.endswith(".tmp") or "o_direct_probe" in n]
    for f in regular:
        assert stat.S_IMODE(os.stat(f).st_mode) == file_mode, f"{f}: {oct(os.stat(f).st_mode)}"
    for f in regular:
        if f.endswith(".bin"):
            assert os.path.getsize(f) == BS + TRAILER_SIZE


# -- config errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("file_mode", "0644x"),
        ("file_mode", "0999"),
        ("file_mode", "0400"),  # the owner could not write its own blocks
        ("file_mode", True),
        ("file_mode", 0o10000),
        ("dir_mode", "0600"),  # no search bit: nothing below could be opened
        ("dir_mode", "rwxrwx---"),
        ("dir_mode", -1),
    ],
)
def test_bad_modes_are_config_errors_naming_the_key(key, value):
    with pytest.raises(TierConfigError) as info:
        TierSettings.from_mapping({"root_dir": "/kv", key: value})
    assert repr(key) in str(info.value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("key", "value", "mode"),
    [
        ("file_mode", "0640", 0o640),
        ("file_mode", "640", 0o640),
        ("file_mode", " 0660 ", 0o660),
        ("file_mode", 0o600, 0o600),
        ("dir_mode", "0700", 0o700),
        ("dir_mode", "2770", 0o2770),
    ],
)
def test_mode_spellings(key, value, mode):
    assert getattr(TierSettings.from_mapping({"root_dir": "/kv", key: value}), key) == mode
