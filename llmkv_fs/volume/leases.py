"""Leases: one small JSON file per running tier under its digest directory,
``<root>/<model>_<digest>/leases/<host>~<pid>~<started_ns>.json``.

A lease says who uses a digest (host, pid, versions) and with which block
hashing (algorithm and a fingerprint of the hash seed, never the seed
itself). Its mtime is its heartbeat: the tier refreshes it every
``interval_s`` and removes it on a clean shutdown. gc keeps a digest with a
live lease; the tier warns when live replicas hash differently (they would
never share a block). vLLM's built-in tier writes no leases.

The tier writes, refreshes and removes its lease beneath the root
(``volume.beneath``): a digest or ``leases`` directory that is a symlink is
refused (LinkInTree), never written through. The root is the pinned one when
given, else the digest directory's parent (a digest directory is a child of
the root by construction).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import stat
import time
from typing import Any

import psutil
import xxhash

from llmkv_fs.layout.names import lease_dir, lease_file_name, parse_lease_file_name
from llmkv_fs.volume.beneath import Beneath, LinkInTree
from llmkv_fs.volume.files import (
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    read_small_regular_file_at,
    write_file_atomically_at,
)
from llmkv_fs.volume.pinned_root import PinnedRoot

__all__ = [
    "LEASE_FILE_LIMIT",
    "STALE_AFTER_INTERVALS",
    "BadLease",
    "Lease",
    "LeaseDir",
    "lease_for",
    "parse_lease",
    "pid_alive",
    "read_lease_dir",
    "read_leases",
    "refresh_lease",
    "remove_lease",
    "seed_fingerprint",
    "write_lease",
]

# A lease not refreshed for this many intervals belongs to a dead process
# (a stalled NFS server may delay a refresh or two; four is not a hiccup).
STALE_AFTER_INTERVALS = 4
# A lease is a few hundred bytes; anything much larger at a lease name is not one.
LEASE_FILE_LIMIT = 64 * 1024


def seed_fingerprint(hash_algo: str, seed: str | None) -> str:
    """A short, one-way fingerprint of how this process hashes blocks.

    Two replicas share blocks only when algorithm and NONE_HASH seed agree.
    ``seed=None`` means a per-process random seed (a non-cryptographic hash
    without PYTHONHASHSEED): such a replica shares with nobody, so its
    fingerprint is unique to it."""
    if seed is None:
        return f"random-{os.urandom(6).hex()}"
    return xxhash.xxh3_64_hexdigest(f"llmkv_fs-seed\0{hash_algo}\0{seed}".encode())


@dataclasses.dataclass(frozen=True)
class Lease:
    host: str
    pid: int
    started_ns: int
    hash_algo: str
    seed_fingerprint: str
    interval_s: float
    vllm_version: str = ""
    llmkv_fs_version: str = ""
    # What else decides whether this replica shares blocks with another
    # (``llmkv-fs doctor`` compares them): the root list it places blocks
    # over, as configured; its sealing keys as "<id>:<key check hex>" (the
    # check identifies a key without revealing it, and every sealed block's
    # trailer carries it already), the write key's first; and its space
    # guard's limits. Empty or zero: not announced (an older replica).
    roots: tuple[str, ...] = ()
    seal_keys: tuple[str, ...] = ()
    max_usage_percent: float = 0.0
    min_free_bytes: int = 0
    # Filled when read from disk: the heartbeat (mtime) and where it lives.
    refreshed: float = 0.0
    path: str = ""

    @property
    def file_name(self) -> str:
        return lease_file_name(self.host, self.pid, self.started_ns)

    def is_live(self, now: float | None = None, this_host: str | None = None) -> bool:
        """Fresh heartbeat, and -- when the lease is from this host -- the pid
        still exists (a crashed process on our own host is provably dead)."""
        now = time.time() if now is None else now
        if now - self.refreshed > STALE_AFTER_INTERVALS * self.interval_s:
            return False
        if this_host is not None and self.host == this_host:
            return pid_alive(self.pid, started_by_ns=self.started_ns)
        return True

    def as_json(self) -> bytes:
        fields = dataclasses.asdict(self)
        del fields["refreshed"], fields["path"]
        for name in ("roots", "seal_keys"):
            fields[name] = list(fields[name])
        return json.dumps(fields, indent=1, sort_keys=True).encode()


# A process's start time is known to the kernel in clock ticks (10 ms);
# a lease is written after its process started, never before.
_START_SLACK_S = 1.0


def pid_alive(pid: int, started_by_ns: int | None = None) -> bool:
    """Whether process ``pid`` of this host still runs (psutil). A zombie
    does not: a SIGKILLed vLLM engine stays one until its parent (or a
    container's PID 1, which may never) reaps it, and its temp files are dead
    already. With ``started_by_ns`` (when the lease or file naming the pid
    was written, wall clock), a process started after that is a new one that
    reused the pid: not the writer, so the writer is dead."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if started_by_ns is not None:
            return bool(proc.create_time() <= started_by_ns / 1e9 + _START_SLACK_S)
        return True
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # exists, but we may not look (another user, hidepid): assume alive


def lease_for(
    hash_algo: str,
    seed_fingerprint: str,
    interval_s: float,
    vllm_version: str,
    llmkv_fs_version: str,
    roots: tuple[str, ...] = (),
    seal_keys: tuple[str, ...] = (),
    max_usage_percent: float = 0.0,
    min_free_bytes: int = 0,
) -> Lease:
    """The lease of this process, starting now (see Lease for the fields)."""
    return Lease(
        host=socket.gethostname(),
        pid=os.getpid(),
        started_ns=time.time_ns(),
        hash_algo=hash_algo,
        seed_fingerprint=seed_fingerprint,
        interval_s=interval_s,
        vllm_version=vllm_version,
        llmkv_fs_version=llmkv_fs_version,
        roots=tuple(roots),
        seal_keys=tuple(seal_keys),
        max_usage_percent=max_usage_percent,
        min_free_bytes=min_free_bytes,
    )


def _beneath(digest_dir: str, root: PinnedRoot | None) -> Beneath:
    """The root a lease under ``digest_dir`` is resolved beneath."""
    if root is not None:
        return Beneath(root.path, root)
    return Beneath(os.path.dirname(digest_dir.rstrip("/")) or "/")


def _open_lease_dir(path: str, root: PinnedRoot | None, create: bool = False) -> int:
    """A descriptor of the ``leases`` directory holding the lease ``path``
    (``<root>/<digest>/leases/<name>``), resolved beneath the root."""
    leases = os.path.dirname(path)
    below = _beneath(os.path.dirname(leases), root)
    return below.open_dir(below.relative(leases), create=create)


def write_lease(
    digest_dir: str,
    lease: Lease,
    file_mode: int = DEFAULT_FILE_MODE,
    dir_mode: int = DEFAULT_DIR_MODE,
    root: PinnedRoot | None = None,
) -> str:
    """Publish ``lease`` under ``digest_dir``; returns its path. The
    directories are resolved (and made) beneath the root: ``root`` when
    pinned (nothing is created unless its path still names it), else
    ``digest_dir``'s parent."""
    path = f"{lease_dir(digest_dir)}/{lease.file_name}"
    below = _beneath(digest_dir, root)
    dir_fd = below.open_dir(below.relative(lease_dir(digest_dir)), create=True, dir_mode=dir_mode)
    try:
        # Not fsynced: a lease lost in a power cut only makes gc see the
        # digest as unleased, and gc still requires its blocks to be old.
        write_file_atomically_at(dir_fd, lease.file_name, lease.as_json(), file_mode, False)
    finally:
        os.close(dir_fd)
    return path


def refresh_lease(path: str, root: PinnedRoot | None = None) -> bool:
    """Bump the heartbeat. False when no lease file of ours is there: gc
    removed a lease it judged dead (e.g. after a long stall), or something
    else took the name or a directory above it (a planted symlink is never
    stamped through); the caller rewrites it, and the rename replaces
    whatever is at the name. ``root``: see write_lease."""
    name = os.path.basename(path)
    try:
        dir_fd = _open_lease_dir(path, root)
    except (FileNotFoundError, NotADirectoryError, LinkInTree):
        return False
    try:
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return False
        os.utime(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    finally:
        os.close(dir_fd)
    return True


def remove_lease(path: str, root: PinnedRoot | None = None) -> bool:
    """Remove a lease; False if the volume refused (read-only, EIO) or a
    directory above it is a symlink now: the lease then simply goes stale,
    which is all gc needs. ``root``: see write_lease."""
    try:
        dir_fd = _open_lease_dir(path, root)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        os.unlink(os.path.basename(path), dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    finally:
        os.close(dir_fd)
    return True


@dataclasses.dataclass(frozen=True)
class BadLease:
    """A file at a lease name that is not a lease we can use, and why.
    ``mtime`` (its lstat's, 0.0 if unknown): gc takes it as a sign of use,
    since a replica may be alive behind a lease it cannot read."""

    path: str
    why: str
    mtime: float = 0.0


@dataclasses.dataclass(frozen=True)
class LeaseDir:
    """What one ``leases/`` directory holds: the valid leases and the bad ones."""

    leases: list[Lease]
    bad: list[BadLease]


# Field name -> accepted JSON types (bool is an int in Python: refused apart).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "host": (str,),
    "pid": (int,),
    "started_ns": (int,),
    "hash_algo": (str,),
    "seed_fingerprint": (str,),
    "interval_s": (int, float),
    "vllm_version": (str,),
    "llmkv_fs_version": (str,),
    "max_usage_percent": (int, float),
    "min_free_bytes": (int,),
}
# Optional list fields: each a JSON list of at most this many strings.
_LIST_FIELDS = ("roots", "seal_keys")
_LIST_LIMIT = 64
_REQUIRED = ("host", "pid", "started_ns", "hash_algo", "seed_fingerprint", "interval_s")


def parse_lease(name: str, data: bytes, refreshed: float, path: str) -> Lease | str:
    """The Lease a file called ``name`` holding ``data`` describes, or why
    it is not one. Untrusted input: every field's type and range is checked,
    and host, pid and start time must agree with the file name."""
    named = parse_lease_file_name(name)
    if named is None:
        return "name is not <host>~<pid>~<started_ns>.json"
    try:
        fields: Any = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        return f"not JSON: {exc}"
    if not isinstance(fields, dict):
        return f"a JSON {type(fields).__name__}, not an object"
    missing = [k for k in _REQUIRED if k not in fields]
    if missing:
        return f"missing {', '.join(missing)}"
    values: dict[str, Any] = {}
    for key, types in _FIELD_TYPES.items():
        if key not in fields:
            continue
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, types):
            return f"{key} is a JSON {type(value).__name__}"
        values[key] = value
    for key in _LIST_FIELDS:
        value = fields.get(key, [])
        if not isinstance(value, list) or len(value) > _LIST_LIMIT:
            return f"{key} is not a list of at most {_LIST_LIMIT} strings"
        if not all(isinstance(item, str) for item in value):
            return f"{key} holds something other than strings"
        values[key] = tuple(value)
    interval = values["interval_s"]
    if not (math.isfinite(interval) and interval > 0):
        return f"interval_s {interval!r} is not a positive finite number"
    if not math.isfinite(values.get("max_usage_percent", 0.0)):
        return "max_usage_percent is not a finite number"
    if values["pid"] <= 0 or values["started_ns"] < 0 or values.get("min_free_bytes", 0) < 0:
        return "pid, started_ns or min_free_bytes out of range"
    if (values["host"], values["pid"], values["started_ns"]) != (
        named.host,
        named.pid,
        named.started_ns,
    ):
        return "host, pid or started_ns differ from the file name"
    return Lease(**values, refreshed=refreshed, path=path)


def _read_one(dir_fd: int, name: str, path: str) -> Lease | str | None:
    """A lease, why the file ``name`` is not one, or None when it is gone."""
    try:
        # The heartbeat from the open file's fstat: the open fetched fresh
        # attributes (NFS close-to-open); a separate stat may answer from an
        # attribute cache up to acregmax (60 s) old.
        data, st = read_small_regular_file_at(dir_fd, name, LEASE_FILE_LIMIT, path)
    except FileNotFoundError:
        return None  # removed meanwhile (a clean shutdown, gc)
    except OSError as exc:
        return exc.strerror or str(exc)
    return parse_lease(name, data, st.st_mtime, path)


def _open_for_reading(digest_dir: str, root: PinnedRoot | None) -> int:
    # Really opened (listing; on NFS the open refetches the directory, so
    # the leases in it are read fresh).
    directory = lease_dir(digest_dir)
    if root is None:  # the ops tools: by path, as they found the digest
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    below = _beneath(digest_dir, root)
    return below.open_dir(below.relative(directory), revalidate=True)


def read_lease_dir(digest_dir: str, root: PinnedRoot | None = None) -> LeaseDir:
    """Every lease of a digest, live or not, and every bad file at a lease
    name (a visible ``*.json``: a symlink, a FIFO, a file of the wrong
    shape). Hidden names (our temp files) are skipped. Never blocks on a
    FIFO, never follows a link at a lease name, never raises for what the
    files hold. ``root`` (the tier): the directories are resolved beneath
    it, and a symlinked digest or leases directory holds no leases."""
    directory = lease_dir(digest_dir)
    try:
        dir_fd = _open_for_reading(digest_dir, root)
    except (FileNotFoundError, NotADirectoryError, LinkInTree):
        return LeaseDir([], [])
    leases, bad = [], []
    try:
        names = os.listdir(dir_fd)
        for name in sorted(names):
            if name.startswith(".") or not name.endswith(".json"):
                continue
            path = f"{directory}/{name}"
            found = _read_one(dir_fd, name, path)
            if isinstance(found, Lease):
                leases.append(found)
            elif found is not None:
                try:
                    mtime = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime
                except OSError:
                    mtime = 0.0
                bad.append(BadLease(path, found, mtime))
    finally:
        os.close(dir_fd)
    return LeaseDir(leases, bad)


def read_leases(digest_dir: str, root: PinnedRoot | None = None) -> list[Lease]:
    """Every valid lease of a digest, live or not; [] when there are none
    (or the digest was written by vLLM's built-in tier). Bad files are
    skipped (``read_lease_dir`` reports them). ``root``: see read_lease_dir."""
    return read_lease_dir(digest_dir, root).leases
