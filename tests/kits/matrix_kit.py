"""Shared helpers for the fault matrix (tests/test_matrix_*.py): real
processes (forked, optionally as another user), real mounts (tmpfs, loop
ext4, the session's GlusterFS volume), and the checks every fault ends with:
no wrong KV byte served, no exception into the scheduler, every published
block file verifies.

Figures: with LLMKV_FS_MATRIX_FIGURES=<file> every test appends one JSON line
of what it injected and observed (docs/reliability.md quotes them).

Waiting is polling with a deadline, never a bare sleep.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import json
import logging
import os
import pwd
import select
import signal
import struct
import subprocess
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pytest
import xxhash
from vllm.v1.kv_offload.base import LookupResult

from llmkv_fs.layout.blockfile import (
    FORMAT_VERSION,
    SEALED_VERSION,
    TRAILER_SIZE,
    BlockFileError,
    verify_block,
)
from llmkv_fs.layout.names import parse_temp_name
from tests.kits.tier_kit import MiB, payload_for, read_primary, wait_until
from tests.kits.user_kit import become

HIT, MISS, RETRY, HIT_PENDING = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.RETRY,
    LookupResult.HIT_PENDING,
)
BLOCK = 2 * MiB  # offloading_config's default chunk size
FIGURES_ENV = "LLMKV_FS_MATRIX_FIGURES"


def record(test: str, **figures) -> None:
    """Append one line of figures for docs/reliability.md (no-op unless
    LLMKV_FS_MATRIX_FIGURES names a file)."""
    path = os.environ.get(FIGURES_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **figures}, sort_keys=True) + "\n")


# -- the scheduler side ------------------------------------------------------------------

TIER_CALLS = (
    "lookup",
    "submit_store",
    "submit_load",
    "get_finished_jobs",
    "on_schedule_end",
    "has_pending_work",
    "on_new_request",
    "on_request_finished",
)


class TierClock:
    """Times every call vLLM's manager makes into the tier (the scheduler
    thread's view) and keeps any exception one raised."""

    def __init__(self, tier):
        self.calls: collections.Counter[str] = collections.Counter()
        self.slowest: dict[str, float] = collections.defaultdict(float)
        self.errors: list[str] = []
        self.since: float | None = None  # only calls after this instant count for `slowest`
        for name in TIER_CALLS:
            setattr(tier, name, self._timed(name, getattr(tier, name)))

    def _timed(self, name: str, real: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            except BaseException as exc:
                self.errors.append(f"{name}: {exc!r}")
                raise
            finally:
                took = time.perf_counter() - start
                self.calls[name] += 1
                self.slowest[name] = max(self.slowest[name], took)

        return timed

    @property
    def max_s(self) -> float:
        return max(self.slowest.values(), default=0.0)


def served(replica, keys: Iterable[bytes], final: dict, ctx) -> tuple[int, int]:
    """(keys served, keys served with wrong bytes): every HIT key is read
    back from the CPU tier the way a GPU load would copy it."""
    hits = wrong = 0
    for key in keys:
        if final.get(key) is HIT:
            hits += 1
            wrong += read_primary(replica, key, ctx) != payload_for(key, replica.row_bytes)
    return hits, wrong


def lookup_until(
    replica, keys: Sequence[bytes], ctx, accept=(HIT, MISS, HIT_PENDING), deadline_s: float = 30.0
) -> dict:
    """Step until every key has a verdict in ``accept``, without stepping
    after the last lookup: HIT_PENDING keys are then promoted but their load
    is not submitted yet (that happens in the next on_schedule_end)."""
    final: dict = {}

    def done() -> bool:
        with replica.manager.lock:
            final.update((k, replica.manager.lookup(k, ctx)) for k in keys)
        if all(final[k] in accept for k in keys):
            return True
        replica.step()
        return False

    wait_until(done, f"lookups to reach {accept}", deadline_s)
    return final


# -- files on the volume -----------------------------------------------------------------


def read_listed(path: str, deadline_s: float = 10.0) -> bytes:
    """The bytes of a file a directory listing just showed. A GlusterFS
    client may still hold the entry of an inode another client's rename
    replaced (its entry cache lives 1 s): open or read then fail with
    ENOENT/ESTALE although the name exists, so retry until the deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ESTALE) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def block_problem(path: str, key: bytes, block_size: int = BLOCK) -> str | None:
    """Why the file at ``path`` is not a complete, correct block of ``key``
    (None: it is one)."""
    data = read_listed(path)
    if len(data) != block_size + TRAILER_SIZE:
        return f"{len(data)} bytes"
    try:
        verify_block(data[:block_size], data[block_size:], key, True)
    except BlockFileError as exc:
        return str(exc)
    if data[:block_size] != payload_for(key, block_size):
        return "verifies but holds other bytes"
    return None


def temp_owner(path: str) -> int | None:
    """The writer pid a temp file's name carries (None: not our temp name)."""
    parsed = parse_temp_name(os.path.basename(path))
    return None if parsed is None else parsed.pid


# -- damaging block files (each takes the path and a valid file of another key) ------------


def flip_bit(path, _donor):
    with open(path, "r+b") as f:
        f.seek(777_777)
        byte = f.read(1)[0]
        f.seek(777_777)
        f.write(bytes([byte ^ 0x01]))


def other_blocks_file(path, donor):
    """A valid block file of another key, under this key's name. Written in
    place: replacing the inode instead makes a second GlusterFS client's
    in-flight load fail with ESTALE (a load error, not a bad file)."""
    with open(donor, "rb") as src, open(path, "r+b") as dst:
        dst.write(src.read())


def future_version(path, _donor):
    """The trailer a later format version would write: self-consistent
    (its own checksum fixed up), only the version differs."""
    with open(path, "r+b") as f:
        f.seek(-TRAILER_SIZE, os.SEEK_END)
        page = bytearray(f.read(TRAILER_SIZE))
        struct.pack_into("<H", page, 8, max(FORMAT_VERSION, SEALED_VERSION) + 1)
        key_end = 42 + struct.unpack_from("<H", page, 40)[0]
        struct.pack_into("<Q", page, key_end, xxhash.xxh3_64_intdigest(bytes(page[:key_end])))
        f.seek(-TRAILER_SIZE, os.SEEK_END)
        f.write(page)


def truncate_half(path, _donor):
    os.truncate(path, os.path.getsize(path) // 2)


def empty(path, _donor):
    os.truncate(path, 0)


# name -> (damage, counter of a load that reads it, whether its size already fails the lookup)
DAMAGES = {
    "bit-flip": (flip_bit, "load_corrupt_bad-checksum", False),
    "wrong-key": (other_blocks_file, "load_corrupt_wrong-key", False),
    "future-version": (future_version, "load_corrupt_bad-version", False),
    "truncated": (truncate_half, "load_corrupt_truncated", True),
    "zero-length": (empty, "load_corrupt_truncated", True),
}


# -- processes ---------------------------------------------------------------------------


def nobody() -> tuple[int, int]:
    entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid


class Forked:
    """``fn(*args)`` in a forked child (vLLM is already imported here, so a
    child starts in milliseconds). Its JSON-able return value, or its
    traceback, comes back through a pipe. ``user=(uid, gid)`` drops root
    first. The child always leaves with os._exit: no atexit handler of the
    parent runs twice."""

    def __init__(self, fn: Callable, *args, user: tuple[int, int] | None = None):
        read_end, write_end = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # child
            code = 1
            try:
                os.close(read_end)
                if user is not None:
                    become(*user)
                outcome = {"ok": True, "value": fn(*args)}
                code = 0
            except BaseException as exc:
                outcome = {"ok": False, "error": repr(exc), "trace": traceback.format_exc()}
            try:
                data = json.dumps(outcome).encode()
                while data:
                    data = data[os.write(write_end, data) :]
            finally:
                os._exit(code)
        os.close(write_end)
        self._read_end: int | None = read_end
        self.status: int | None = None

    def _close(self) -> None:
        if self._read_end is not None:
            os.close(self._read_end)
            self._read_end = None

    def result(self, deadline_s: float = 120.0):
        """The child's return value; raises AssertionError with the child's
        traceback if it raised, and kills it at the deadline."""
        chunks, deadline = [], time.monotonic() + deadline_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._read_end], [], [], left)[0]:
                    self.kill()
                    raise AssertionError(f"child {self.pid} still running after {deadline_s}s")
                chunk = os.read(self._read_end, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            self._close()
        self.wait()
        outcome = json.loads(b"".join(chunks) or b'{"ok": false, "error": "no result"}')
        if not outcome["ok"]:
            raise AssertionError(
                f"child {self.pid} failed: {outcome.get('trace', outcome['error'])}"
            )
        return outcome["value"]

    def wait(self) -> int:
        if self.status is None:
            self.status = os.waitpid(self.pid, 0)[1]
        return self.status

    def exited(self) -> bool:
        """Whether the child is gone (reaps it if so)."""
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
        return self.status is not None

    def kill(self) -> bool:
        """SIGKILL (its result is dropped); True if it was still running."""
        alive = not self.exited()
        if alive:
            os.kill(self.pid, signal.SIGKILL)
            self.wait()
        self._close()
        return alive


class LogTap(logging.Handler):
    """Collects the tier's warnings (in a child, to send them back)."""

    def __init__(self, logger: str = "vllm.llmkv_fs"):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        logging.getLogger(logger).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


# -- mounts ------------------------------------------------------------------------------


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


def unmount(path: str) -> None:
    for _ in range(100):
        if not os.path.ismount(path) or _run(["umount", path]).returncode == 0:
            return
        time.sleep(0.05)
    _run(["umount", "-l", path])


@contextlib.contextmanager
def loop_ext4(where: Path, size_mb: int = 64):
    """A fresh ext4 of our own at ``where``: an image file next to it,
    loop-mounted. Skips without root or loop devices."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    where.mkdir(parents=True, exist_ok=True)
    image = where.parent / f"{where.name}.img"
    with open(image, "wb") as f:
        f.truncate(size_mb * MiB)
    made = _run(
        ["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", str(image)]
    )
    if made.returncode:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    done = _run(["mount", "-o", "loop", str(image), str(where)])
    if done.returncode:
        pytest.skip(f"cannot loop-mount an ext4 image here: {done.stderr.strip()}")
    try:
        yield str(where)
    finally:
        unmount(str(where))


def remount(path: str, options: str, deadline_s: float = 20.0) -> float:
    """``mount -o remount,<options>``; a read-only remount is refused (EBUSY)
    while a file is open for writing, so it is retried between writes.
    Returns how long it took."""
    start = time.monotonic()
    while True:
        done = _run(["mount", "-o", f"remount,{options}", path])
        if done.returncode == 0:
            return time.monotonic() - start
        if time.monotonic() - start > deadline_s:
            raise AssertionError(f"remount,{options} of {path} failed: {done.stderr.strip()}")
        time.sleep(0.002)


_EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
_EXT4_GOING_FLAGS_NOLOGFLUSH = 2


def ext4_shutdown(path: str) -> None:
    """Shut the ext4 filesystem under ``path`` down: from now on the kernel
    answers reads, writes, creates and renames with EIO -- what ext4 does
    when its device fails (the ``dmsetup`` error target needs device-mapper,
    which not every kernel has)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _EXT4_GOING_FLAGS_NOLOGFLUSH))
    finally:
        os.close(fd)


# -- GlusterFS ---------------------------------------------------------------------------


def gluster_dirs(vol, tag: str) -> tuple[str, str]:
    """A fresh directory on the session's GlusterFS volume: (via mount A,
    via mount B)."""
    name = f"llmkv_matrix_{tag}_{os.getpid()}_{time.monotonic_ns():x}"
    os.makedirs(f"{vol.mount_a}/{name}")
    return f"{vol.mount_a}/{name}", f"{vol.mount_b}/{name}"


def brick_pid(vol) -> int:
    """The glusterfsd serving this volume's brick (and nothing else)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if (
            os.path.basename(argv[0]) == "glusterfsd"
            and "--brick-name" in argv
            and argv[argv.index("--brick-name") + 1] == vol.brick
        ):
            found.append(int(entry))
    assert len(found) == 1, f"glusterfsd for {vol.brick}: {found}"
    return found[0]


@contextlib.contextmanager
def stopped(pid: int):
    """SIGSTOP ``pid`` for the duration; SIGCONT always, whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
