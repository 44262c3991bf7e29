"""Leases: one small JSON file per running tier under its digest directory,
``<root>/<model>_<digest>/leases/<host>~<pid>~<started_ns>.json``.

A lease says who uses a digest (host, pid, versions) and with which block
hashing (algorithm and a fingerprint of the hash seed, never the seed
itself). Its mtime is its heartbeat: the tier refreshes it every
``interval_s`` and removes it on a clean shutdown. gc keeps a digest with a
live lease; the tier warns when live replicas hash differently (they would
never share a block). vLLM's built-in tier writes no leases.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from typing import Any

import xxhash

from llmkv_fs.layout.files import (
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    read_revalidated,
    write_file_atomically,
)
from llmkv_fs.layout.names import lease_dir, lease_file_name, parse_lease_file_name

__all__ = [
    "STALE_AFTER_INTERVALS",
    "Lease",
    "lease_for",
    "pid_alive",
    "read_leases",
    "refresh_lease",
    "remove_lease",
    "seed_fingerprint",
    "write_lease",
]

# A lease not refreshed for this many intervals belongs to a dead process
# (a stalled NFS server may delay a refresh or two; four is not a hiccup).
STALE_AFTER_INTERVALS = 4


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
            return pid_alive(self.pid)
        return True

    def as_json(self) -> bytes:
        fields = dataclasses.asdict(self)
        del fields["refreshed"], fields["path"]
        return json.dumps(fields, indent=1, sort_keys=True).encode()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def lease_for(
    hash_algo: str,
    seed_fingerprint: str,
    interval_s: float,
    vllm_version: str,
    llmkv_fs_version: str,
) -> Lease:
    """The lease of this process, starting now."""
    return Lease(
        host=socket.gethostname(),
        pid=os.getpid(),
        started_ns=time.time_ns(),
        hash_algo=hash_algo,
        seed_fingerprint=seed_fingerprint,
        interval_s=interval_s,
        vllm_version=vllm_version,
        llmkv_fs_version=llmkv_fs_version,
    )


def write_lease(
    digest_dir: str,
    lease: Lease,
    file_mode: int = DEFAULT_FILE_MODE,
    dir_mode: int = DEFAULT_DIR_MODE,
) -> str:
    path = f"{lease_dir(digest_dir)}/{lease.file_name}"
    # Not fsynced: a lease lost in a power cut only makes gc see the digest
    # as unleased, and gc still requires its blocks to be old.
    write_file_atomically(path, lease.as_json(), file_mode, dir_mode, durable=False)
    return path


def refresh_lease(path: str) -> bool:
    """Bump the heartbeat. False when the lease file is gone (gc removed a
    lease it judged dead, e.g. after a long stall): the caller rewrites it."""
    try:
        os.utime(path)
    except FileNotFoundError:
        return False
    return True


def remove_lease(path: str) -> bool:
    """Remove a lease; False if the volume refused (read-only, EIO): the
    lease then simply goes stale, which is all gc needs."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _parse(path: str, name: str) -> Lease | None:
    if parse_lease_file_name(name) is None:
        return None
    try:
        # The heartbeat from the open file's fstat: the open fetched fresh
        # attributes (NFS close-to-open); a separate stat may answer from an
        # attribute cache up to acregmax (60 s) old.
        data, st = read_revalidated(path)
        fields: dict[str, Any] = json.loads(data)
        refreshed = st.st_mtime
    except (OSError, ValueError):
        return None
    known = {f.name for f in dataclasses.fields(Lease)} - {"refreshed", "path"}
    try:
        values = {k: v for k, v in fields.items() if k in known}
        return Lease(**values, refreshed=refreshed, path=path)
    except TypeError:
        return None


def read_leases(digest_dir: str) -> list[Lease]:
    """Every parsable lease of a digest, live or not; [] when there are none
    (or the digest was written by vLLM's built-in tier)."""
    directory = lease_dir(digest_dir)
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    leases = []
    for name in sorted(names):
        lease = _parse(f"{directory}/{name}", name)
        if lease is not None:
            leases.append(lease)
    return leases
