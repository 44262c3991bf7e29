"""Helpers for the gc tests: real trees of real files with chosen ages, real
leases, dead and live pids, and gc run in-process or as a real process.
No vLLM, no torch."""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from llmkv_fs.cli import main as cli_main
from llmkv_fs.layout.blockfile import TRAILER_SIZE, pack_trailer, payload_checksum
from llmkv_fs.layout.paths import CacheLayout, RunIdentity
from llmkv_fs.volume.leases import Lease, write_lease
from llmkv_fs.volume.run_config import ensure_run_config
from tests.kits import REPO
from tests.kits.names_kit import temp_path
from tests.kits.nfs_kit import in_guest

HOST = socket.gethostname()
DAY = 86400.0
PAYLOAD = 4096  # tiny blocks: gc never reads payloads
# Waits for a gc process to start and reach a point (open its lock file, print a
# line). A start is ~1 s here and 25-30 s in the NFS guest under emulation
# (test_python_m_runs_without_vllm_or_torch[nfs]: 28.8 s in CI on 2026-11-27, when
# 30 s was this deadline everywhere and a lock test in the guest missed it).
DEADLINE_S = 150.0 if in_guest() else 30.0
SRC = str(REPO)


def identity(
    model: str = "acme/llama", rank: int = 0, tp: int = 1, dtype: str = "bfloat16"
) -> RunIdentity:
    return RunIdentity(
        model_name=model,
        dtype=dtype,
        tokens_per_hash=16,
        blocks_per_file=1,
        kv_cache_groups=((16, ("layer.0",)),),
        tp_size=tp,
        rank=rank,
    )


def make_digest(
    root: str,
    model: str = "acme/llama",
    ranks=(0,),
    dtype: str = "bfloat16",
    config_age: float = 0.0,
) -> list[CacheLayout]:
    """config.json (as the tier writes it) and one layout per rank."""
    layouts = [CacheLayout.for_identity(root, identity(model, r, len(ranks), dtype)) for r in ranks]
    ensure_run_config(layouts[0])
    if config_age:
        age(layouts[0].config_path, config_age)
    for layout in layouts:
        os.makedirs(layout.rank_dir, exist_ok=True)
    return layouts


def key(i, seed: str = "k", group: int = 0, prefix: bytes = b"") -> bytes:
    digest = hashlib.sha256(f"{seed}-{i}".encode()).digest()
    return (prefix + digest)[:32] + group.to_bytes(4, "big")


def age(path: str, seconds: float, atime_age: float | None = None) -> None:
    """Set mtime (and atime) to ``seconds`` ago; atime separately if given."""
    now = time.time()
    a = now - (seconds if atime_age is None else atime_age)
    os.utime(path, (a, now - seconds), follow_symlinks=False)


def block_bytes(k: bytes, payload: int = PAYLOAD) -> bytes:
    data = (hashlib.sha256(k).digest() * (payload // 32 + 1))[:payload]
    page = memoryview(mmap.mmap(-1, TRAILER_SIZE))
    pack_trailer(page, k, payload, payload_checksum(data), time.time_ns())
    return data + bytes(page)


def put_block(
    layout: CacheLayout,
    k: bytes,
    seconds_old: float = 0.0,
    used_ago: float | None = None,
    payload: int = PAYLOAD,
) -> str:
    """A block file as the tier publishes it, stored ``seconds_old`` ago and
    last loaded ``used_ago`` ago (its atime stamp)."""
    path = layout.block_path(k)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(block_bytes(k, payload))
    age(path, seconds_old, used_ago)
    return path


def put_temp(
    layout: CacheLayout,
    k: bytes,
    pid: int,
    host: str = HOST,
    seconds_old: float = 0.0,
    nonce: str = "1a2b",
) -> str:
    path = temp_path(layout.block_path(k), host, pid, nonce)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\0" * 1000)
    age(path, seconds_old)
    return path


def put_lease(
    layout: CacheLayout,
    pid: int,
    host: str = HOST,
    seconds_old: float = 0.0,
    interval: float = 30.0,
) -> str:
    lease = Lease(
        host=host,
        pid=pid,
        started_ns=time.time_ns(),
        hash_algo="sha256",
        seed_fingerprint="f" * 16,
        interval_s=interval,
    )
    path = write_lease(layout.base_path, lease)
    age(path, seconds_old)
    return path


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def cache_entries(root: str) -> set[str]:
    """What gc may act on below ``root``, relative to it: files and links
    to directories, without gc's own lock file."""
    out = set()
    for directory, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(directory, d))]:
            out.add(os.path.relpath(os.path.join(directory, name), root))
    return out - {".llmkv-gc.lock"}


def snapshot(root: str) -> dict[str, tuple]:
    """Every entry (dirs included) with type, size, inode and times, except
    gc's own lock file. The atime of lease files and config.json is left
    out: gc reads them (a config.json proves a digest ours) and relatime
    stamps the read; block atimes are in -- they are the LRU clock, and gc
    must never touch them."""
    out = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, root)
            if rel == ".llmkv-gc.lock":
                continue
            st = os.lstat(path)
            read_by_gc = os.path.isdir(path) or "/leases/" in f"/{rel}" or name == "config.json"
            out[rel] = (
                st.st_mode,
                st.st_size,
                st.st_ino,
                st.st_mtime_ns,
                None if read_by_gc else st.st_atime_ns,
            )
    return out


def gc(root: str, *args: str, capsys=None) -> tuple[int, dict]:
    """gc in this process with --json; returns (status, report). Pid
    evidence is on unless a test says otherwise (``auto`` would turn it off
    if these tests ran in a Kubernetes pod)."""
    if "--pid-check" not in args:
        args = (*args, "--pid-check", "on")
    status = cli_main(["gc", root, "--json", *args])
    report = {}
    if capsys is not None:
        out = capsys.readouterr().out
        report = json.loads(out) if out.strip() else {}
    return status, report


def gc_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return env


def gc_process(root: str, *args: str, **popen) -> subprocess.Popen:
    """gc as a real process (``python -m llmkv_fs gc``)."""
    return subprocess.Popen(
        [sys.executable, "-m", "llmkv_fs", "gc", root, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=gc_env(),
        **popen,
    )


@contextlib.contextmanager
def running(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """``proc``, killed on the way out if it is still running (a failed test)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stop_watch(watcher: subprocess.Popen) -> list[dict]:
    """SIGTERM a ``--watch --json`` gc: it must exit 0. The reports of the
    passes it printed since it was last read."""
    watcher.send_signal(signal.SIGTERM)
    out, err = watcher.communicate(timeout=60)
    assert watcher.returncode == 0, err
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def gc_run(root: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmkv_fs", "gc", root, *args],
        capture_output=True,
        text=True,
        env=gc_env(),
        timeout=timeout,
    )


# -- the gc lock, held by another process -----------------------------------


def read_line(stream, deadline_s: float = 120.0) -> str:  # bounds a hang only
    ready, _, _ = select.select([stream], [], [], deadline_s)
    assert ready, f"no output within {deadline_s}s"
    return stream.readline()


HOLDER = r"""
import sys
from llmkv_fs.ops.gc.lock import VolumeLock
lock = VolumeLock(sys.argv[1])
lock.acquire()
print('locked', flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def lock_held(root: str) -> Iterator[subprocess.Popen]:
    """Another process holds the volume's gc lock until its stdin closes."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, root],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=gc_env(),
    )
    with running(holder):
        assert read_line(holder.stdout) == "locked\n"
        yield holder
