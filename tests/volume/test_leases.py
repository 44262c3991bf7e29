"""Leases through vLLM's real TieringOffloadingManager: published at the first
scheduling step, refreshed, rewritten when gc removed it, removed on close;
and replica processes with different PYTHONHASHSEED warn that they will not
share cache -- and really do not -- while equal seeds share byte-exact.

The seed tests run replicas as subprocesses of this very file (see the bottom):
NONE_HASH is a process global that vLLM's EngineCore sets once, so each
replica needs its own interpreter.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

import llmkv_fs
from llmkv_fs.engine import Outcome
from llmkv_fs.engine.upkeep import housekeeping as housekeeping_module
from llmkv_fs.engine.upkeep.space import SpaceGuard
from llmkv_fs.volume.leases import Lease, lease_dir, read_leases
from tests.kits import REPO
from tests.kits.clock_kit import JUST_BEFORE_S, ManualClock
from tests.kits.engine_kit import IO_WORKERS_ENV, housekeeping_rounds
from tests.kits.tier_kit import (
    Replica,
    assert_io_mode,
    offloading_config,
    ours,
    payload_for,
    read_primary,
    wait_until,
)

WARNING = "will not share cache"
TOKENS = list(range(1000, 1016))  # one full 16-token block


def leases_of(replica) -> list:
    return read_leases(replica.tier.engine.roots[0].layout.base_path)


def own_leases(replica) -> list:
    return [x for x in leases_of(replica) if (x.host, x.pid) == (socket.gethostname(), os.getpid())]


def wait_for_lease(replica):
    """This process's lease (other replicas may have theirs in the same digest)."""
    wait_until(lambda: own_leases(replica), "the lease to be written", 20.0)
    (lease,) = own_leases(replica)
    return lease


def wait_for_refresh(path: str, after_ns: int) -> int:
    def refreshed():
        try:
            return os.stat(path).st_mtime_ns > after_ns
        except FileNotFoundError:
            return False

    wait_until(refreshed, f"{path} to be refreshed", 20.0)
    return os.stat(path).st_mtime_ns


# -- one replica, in this process -----------------------------------------------------------


@pytest.mark.usefixtures("io_mode")  # the tier's I/O threads or worker processes
def test_lease_lifecycle(disk_root):
    from vllm import __version__ as vllm_version

    from llmkv_fs.tier.hashing import hashing_identity

    started = time.time_ns()
    replica = Replica(offloading_config(tiers=[ours(disk_root, lease_interval_s=0.5)]))
    closed = False
    try:
        assert_io_mode(replica)
        engine = replica.tier.engine
        # Before the first step the hash seed is not known yet: no lease, even
        # after the housekeeping thread has been round once.
        housekeeping_rounds(engine.roots[0].housekeeping, 2)  # a whole round
        assert leases_of(replica) == []

        replica.step()
        lease = wait_for_lease(replica)
        assert leases_of(replica) == [lease]  # the only replica on this root
        algo, fingerprint = hashing_identity()
        assert (lease.host, lease.pid) == (socket.gethostname(), os.getpid())
        assert (lease.hash_algo, lease.seed_fingerprint) == (algo, fingerprint)
        assert lease.vllm_version == vllm_version
        assert lease.llmkv_fs_version == llmkv_fs.__version__
        assert lease.interval_s == 0.5
        assert started <= lease.started_ns <= time.time_ns()
        assert os.path.dirname(lease.path) == lease_dir(
            replica.tier.engine.roots[0].layout.base_path
        )
        assert os.path.basename(lease.path) == lease.file_name
        with open(lease.path, "rb") as f:
            on_disk = json.loads(f.read())
        assert on_disk["seed_fingerprint"] == fingerprint and "path" not in on_disk
        # Live: fresh at the instant it was read, and its pid (ours) runs.
        assert lease.is_live(now=lease.refreshed, this_host=socket.gethostname())

        # More steps do not publish another lease; the heartbeat moves on.
        mtime = os.stat(lease.path).st_mtime_ns
        replica.step()
        replica.step()
        mtime = wait_for_refresh(lease.path, mtime)
        assert wait_for_refresh(lease.path, mtime) > mtime
        assert [x.path for x in leases_of(replica)] == [lease.path]

        # gc judged us dead and removed the lease: the next refresh rewrites it.
        os.unlink(lease.path)
        wait_until(lambda: os.path.exists(lease.path), "the lease to be rewritten", 20.0)
        (again,) = leases_of(replica)
        assert again.path == lease.path and again.started_ns == lease.started_ns
        assert again.seed_fingerprint == fingerprint

        replica.close()
        closed = True
        assert leases_of(replica) == []
        assert os.listdir(lease_dir(replica.tier.engine.roots[0].layout.base_path)) == []
    finally:
        if not closed:
            replica.close()


class _RecordingEvent(threading.Event):
    """A housekeeping thread's wake-up event that keeps every wait's timeout."""

    def __init__(self):
        super().__init__()
        self.timeouts: list[float | None] = []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        return super().wait(timeout)


@pytest.mark.usefixtures("io_mode")
def test_short_lease_interval_is_refreshed_before_it_looks_dead(disk_root, monkeypatch):
    """A lease refreshed less often than its interval looks dead to gc and
    peers after STALE_AFTER_INTERVALS of them. Asserted on the schedule, not
    on how late a loaded machine woke the thread: the housekeeping thread
    wakes at least twice per interval, and refreshes the lease when its
    clock passes the interval -- not before."""
    interval = 0.2
    clock = ManualClock().install(monkeypatch, housekeeping_module)
    replica = Replica(offloading_config(tiers=[ours(disk_root, lease_interval_s=interval)]))
    try:
        keeper = replica.tier.engine.roots[0].housekeeping
        ticks = keeper._wake = _RecordingEvent()  # read by the thread every round
        replica.step()
        lease = wait_for_lease(replica)
        mtime = os.stat(lease.path).st_mtime_ns
        clock.advance(interval - JUST_BEFORE_S)
        housekeeping_rounds(keeper, 2)  # a whole round ran after the clock moved
        assert os.stat(lease.path).st_mtime_ns == mtime, "refreshed before its interval"
        clock.advance(JUST_BEFORE_S)
        wait_for_refresh(lease.path, mtime)
        # Woken at least twice per interval: a refresh is never more than
        # half an interval late on the thread's own schedule.
        assert ticks.timeouts and max(ticks.timeouts) <= interval / 2, ticks.timeouts
    finally:
        replica.close()


# -- replicas in separate processes ---------------------------------------------------------


def _spawn(
    role: str, seed: str, root: str, control: str, log_path: str, io_workers: str
) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONHASHSEED": seed,
        "LLMKV_FS_HASH_ALGO": "xxhash",
        IO_WORKERS_ENV: io_workers,  # harness.ours: the replica's io mode
        "PYTHONPATH": str(REPO),  # the script imports tests.kits
    }
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), role, root, control],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )


def _result(log_path: str, proc: subprocess.Popen, deadline_s: float = 900.0) -> dict:
    """Wait for the RESULT line a replica process prints."""
    deadline = time.monotonic() + deadline_s
    while True:
        with open(log_path, "rb") as f:
            for line in f.read().decode(errors="replace").splitlines():
                if line.startswith("RESULT "):
                    return json.loads(line[len("RESULT ") :])
        if proc.poll() is not None and proc.returncode != 0:
            with open(log_path, "rb") as f:
                pytest.fail(f"replica process failed:\n{f.read().decode(errors='replace')[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no result from {log_path} after {deadline_s}s")
        time.sleep(0.05)


@pytest.fixture(scope="module", params=["0", "1"], ids=["threads", "workers"])
def seed_run(tmp_path_factory, request):
    """Three replica processes sharing one root: A (seed 1234) stores a block
    and stays up; then B (seed 4321) and, after B exited, C (seed 1234) look
    the same tokens up. All three import vLLM at once; they only start their
    replicas when told to, in that order. Once with I/O threads, once with
    worker processes (module scope: the io_mode fixture is per test)."""
    io_workers = request.param
    base = tmp_path_factory.mktemp("seeds")
    root, control = base / "kv", base / "control"
    root.mkdir()
    control.mkdir()
    logs = {r: str(base / f"{r}.log") for r in "ABC"}
    procs = {
        "A": _spawn("writer", "1234", str(root), str(control / "A"), logs["A"], io_workers),
        "B": _spawn("reader", "4321", str(root), str(control / "B"), logs["B"], io_workers),
        "C": _spawn("reader", "1234", str(root), str(control / "C"), logs["C"], io_workers),
    }
    try:
        results = {}
        for role in "ABC":
            (control / f"{role}.go").touch()
            results[role] = _result(logs[role], procs[role])
            if role == "B":
                assert procs["B"].wait(60) == 0
                # B is gone, and its lease with it: only A's is left.
                results["after_B"] = [x.pid for x in read_leases(results["A"]["base"])]
        (control / "A.quit").touch()
        assert procs["A"].wait(60) == 0
        assert procs["C"].wait(60) == 0
        results["after_all"] = read_leases(results["A"]["base"])
        for role in "ABC":
            with open(logs[role], "rb") as f:
                results[f"log_{role}"] = f.read().decode(errors="replace")
        results["root"] = str(root)
        for role in "ABC":
            assert bool(results[role]["io_workers"]) == (io_workers != "0"), results[role]
        yield results
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# Three replica processes, each a fresh interpreter importing vLLM (~20 s of
# CPU each): the integration lane.
@pytest.mark.integration
def test_different_seeds_warn_and_do_not_share(seed_run):
    a, b = seed_run["A"], seed_run["B"]
    assert a["pid"] != b["pid"]
    assert a["hash_algo"] == b["hash_algo"] == "xxhash"
    assert a["fingerprint"] != b["fingerprint"]
    assert a["key"] != b["key"]  # the same tokens hash differently
    assert os.path.exists(a["path"])  # A's block is on the volume ...
    assert b["verdict"] == "MISS" and not os.path.exists(b["path"])  # ... B can't see it
    assert WARNING in seed_run["log_B"]
    assert a["fingerprint"] in seed_run["log_B"] and b["fingerprint"] in seed_run["log_B"]
    assert b["other_fingerprints"] == [a["fingerprint"]]
    assert seed_run["after_B"] == [a["pid"]]


@pytest.mark.integration
def test_same_seed_shares_byte_exact_without_warning(seed_run):
    a, c = seed_run["A"], seed_run["C"]
    assert c["fingerprint"] == a["fingerprint"]
    assert c["key"] == a["key"] and c["path"] == a["path"]
    assert c["verdict"] == "HIT" and c["bytes_ok"] is True
    assert c["verified"] == 1
    assert WARNING not in seed_run["log_C"]
    assert c["other_fingerprints"] == []
    assert c["peers_seen"] == 1  # A's lease was live when C checked
    assert seed_run["after_all"] == []  # every replica removed its lease on close


# -- the replica process (python test_leases.py writer|reader ROOT CONTROL) -----------------


def _wait_file(path: str, deadline_s: float = 1200.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} never appeared")
        time.sleep(0.05)


def _replica_process(role: str, root: str, control: str) -> None:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_offload.base import LookupResult, make_offload_key

    # What EngineCore does before the scheduler runs.
    hash_fn = get_hash_fn_by_name("xxhash")
    kv_cache_utils.init_none_hash(hash_fn)
    block_hash = kv_cache_utils.hash_block_tokens(hash_fn, kv_cache_utils.NONE_HASH, TOKENS)
    key = make_offload_key(bytes(block_hash), 0)

    _wait_file(f"{control}.go")
    replica = Replica(
        offloading_config(tiers=[ours(root, lease_interval_s=1.0)], cpu_bytes=16 << 20)
    )
    housekeeping = replica.tier.engine.roots[0].housekeeping
    replica.step()
    lease = wait_for_lease(replica)
    # The peer check runs right after each write or refresh of our lease:
    # once the lease was refreshed, the first check is complete.
    wait_for_refresh(lease.path, os.stat(lease.path).st_mtime_ns)
    out = {
        "pid": os.getpid(),
        "fingerprint": lease.seed_fingerprint,
        "hash_algo": lease.hash_algo,
        "key": key.hex(),
        "path": replica.tier.engine.roots[0].layout.block_path(key),
        "base": replica.tier.engine.roots[0].layout.base_path,
        "io_workers": replica.tier.engine.io_workers,
        "other_fingerprints": sorted(housekeeping.other_fingerprints),
        "peers_seen": sum(
            x.is_live(this_host=socket.gethostname())
            for x in read_leases(replica.tier.engine.roots[0].layout.base_path)
            if x.path != lease.path
        ),
    }
    if role == "writer":
        replica.store([key])
        assert os.path.exists(out["path"])
        print("RESULT " + json.dumps(out), flush=True)
        _wait_file(f"{control}.quit")
    else:
        ctx = replica.new_request()
        final, _ = replica.find([key], ctx)
        out["verdict"] = final[key].name
        if final[key] is LookupResult.HIT:
            out["bytes_ok"] = read_primary(replica, key, ctx) == payload_for(key, replica.row_bytes)
        out["verified"] = replica.tier.engine.counters[Outcome.VERIFIED]
    replica.close()
    if role != "writer":
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    _replica_process(*sys.argv[1:4])


def test_housekeeping_survives_a_failed_first_lease_write(tmp_path, monkeypatch):
    """The first write of the lease fails (EIO): the thread stays up, keeps
    sampling space and writes the lease on a later round -- it must not
    "refresh" a lease file that was never written."""
    real_write = housekeeping_module.write_lease
    calls = []

    def write_once_failing(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(housekeeping_module, "write_lease", write_once_failing)
    guard = SpaceGuard(str(tmp_path), 100.0, 0, headroom_bytes=0)
    keeper = housekeeping_module.Housekeeping(guard, str(tmp_path), lease_interval_s=0.05)
    try:
        keeper.set_lease(
            Lease(
                host=socket.gethostname(),
                pid=os.getpid(),
                started_ns=time.time_ns(),
                hash_algo="sha256",
                seed_fingerprint="f" * 16,
                interval_s=0.05,
            )
        )
        wait_until(lambda: keeper.lease_path is not None, "the lease to be written", 20.0)
        assert os.path.exists(keeper.lease_path)
        assert keeper.errors == 1
        seen = guard.usage
        wait_until(lambda: guard.usage is not seen, "a later housekeeping round", 20.0)
    finally:
        keeper.stop()


def test_a_zombie_writer_is_not_alive():
    """A SIGKILLed process nobody has reaped yet is dead for gc and leases."""
    import signal

    from llmkv_fs.volume.leases import pid_alive

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(child.pid):  # a zombie until we reap it below
            assert time.monotonic() < deadline, "a killed, unreaped child still counts as alive"
            time.sleep(0.01)
        os.kill(child.pid, 0)  # still there: kill(0) alone would call it alive
    finally:
        child.kill()
        child.wait()
    assert not pid_alive(child.pid)
