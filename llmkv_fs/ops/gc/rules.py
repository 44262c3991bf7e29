"""gc's decisions, separate from its actions: which digests are orphaned,
which temp files are dead, how many bytes capacity asks for and which blocks
(least recently used first) give them. Reads facts, touches no file (except
asking the kernel whether a pid exists)."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Set as AbstractSet

import psutil

from llmkv_fs.layout.names import temp_writer
from llmkv_fs.ops.gc.inventory import DigestFacts, Inventory
from llmkv_fs.ops.kinds import FileEntry
from llmkv_fs.units import format_bytes, format_duration
from llmkv_fs.volume import fsinfo
from llmkv_fs.volume.leases import pid_alive

__all__ = [
    "Capacity",
    "Policy",
    "capacity_need",
    "digest_verdict",
    "pick_lru",
    "pids_are_ours",
    "temp_verdict",
    "volume_usage",
]


@dataclasses.dataclass(frozen=True)
class Policy:
    min_age: float
    tmp_age: float
    protect: float
    max_bytes: int | None
    high: float | None
    low: float | None
    pid_check: bool
    host: str = dataclasses.field(default_factory=socket.gethostname)

    @property
    def lease_host(self) -> str | None:
        """The host whose pids we may check (None: trust heartbeats only)."""
        return self.host if self.pid_check else None


def pids_are_ours() -> bool:
    """Whether a pid written by a process of this host name is a pid of our
    pid namespace. Not so in a Kubernetes sidecar: it shares the pod's host
    name but, unless the pod sets ``shareProcessNamespace: true``, not its
    pids, and "no such pid" would wrongly mean "dead". With a shared
    namespace pid 1 is the pod's pause process."""
    if "KUBERNETES_SERVICE_HOST" not in os.environ:
        return True
    try:
        return bool(psutil.Process(1).name() == "pause")
    except psutil.Error:
        return False


def digest_verdict(facts: DigestFacts, now: float, policy: Policy) -> tuple[bool, str]:
    """(remove?, why) for one digest, from the scan's facts and its leases."""
    if facts.pinned:
        return False, "pinned by --keep"
    ours, why_not = facts.provably_ours()
    if not ours:
        return False, f"not provably a cache digest ({why_not}); left alone"
    if facts.lease_error:
        return False, f"its leases cannot be read ({facts.lease_error})"
    live = [lease for lease in facts.leases if lease.is_live(now, policy.lease_host)]
    if live:
        return False, "live lease " + ", ".join(f"{x.host}~{x.pid}" for x in live)
    if facts.unreadable:
        return False, f"{facts.unreadable} directories or files in it could not be read"
    # A replica may be alive behind a lease we cannot read: its mtime is a sign of use.
    newest, newest_what = facts.newest, facts.newest_what
    for bad in facts.bad_leases:
        if bad.mtime > newest:
            newest, newest_what = bad.mtime, bad.path
    idle = now - newest
    if idle < policy.min_age:
        return False, f"used {idle:.0f}s ago"
    why = "stale leases only" if facts.leases else "no lease"
    what = os.path.relpath(newest_what, facts.digest.root) if newest_what else "empty"
    return True, f"{why}, idle {format_duration(idle)} (newest: {what})"


def temp_verdict(entry: FileEntry, now: float, policy: Policy) -> tuple[bool, str]:
    """(remove?, why) for one temp file. A temp file of a writer that is
    alive on this host is never removed, however old."""
    writer = temp_writer(os.path.basename(entry.path))
    if writer is not None and policy.pid_check and writer[0] == policy.host:
        # ctime (no utime can set it back) is never before the writer
        # started: a process started after it reused the pid.
        if pid_alive(writer[1], started_by_ns=int(entry.st.st_ctime * 1e9)):
            return False, f"writer pid {writer[1]} is alive"
        return True, f"writer pid {writer[1]} is gone"
    # Another host's, or vLLM's built-in tier's (its names carry no writer).
    age = now - entry.st.st_mtime
    if age >= policy.tmp_age:
        return True, f"{age:.0f}s old"
    return False, f"{age:.0f}s old, writer unknown or on another host"


@dataclasses.dataclass(frozen=True)
class Capacity:
    total: int  # the volume's usable size, bytes: used + available to non-root (df's size)
    used: int  # used as df counts it
    cache: int  # bytes under the selected digests

    @property
    def used_percent(self) -> float:
        return fsinfo.used_percent(self.used, self.total) if self.total else 0.0


def volume_usage(root: str, cache_bytes: int) -> Capacity:
    """Use% as ``df`` shows it: used / (used + available to non-root)."""
    usage = fsinfo.volume_usage(root)
    return Capacity(usage.usable_bytes, usage.used_bytes, cache_bytes)


def capacity_need(cap: Capacity, freed: int, policy: Policy) -> tuple[int, str]:
    """Bytes to evict after ``freed`` bytes already went, and why. The
    watermark triggers on the volume's use at the start of the pass (high)
    and then aims for the low mark; --max-bytes aims for itself."""
    need, why = 0, ""
    if policy.high is not None and cap.total and cap.used_percent >= policy.high:
        low = policy.low if policy.low is not None else policy.high
        over = cap.used - freed - int(low / 100.0 * cap.total)
        if over > need:
            need, why = (
                over,
                f"volume {cap.used_percent:.1f}% used >= high {policy.high:g}%, "
                f"target low {low:g}%",
            )
    if policy.max_bytes is not None:
        over = cap.cache - freed - policy.max_bytes
        if over > need:
            need, why = (
                over,
                (
                    f"cache {format_bytes(cap.cache - freed)} > --max-bytes "
                    f"{format_bytes(policy.max_bytes)}"
                ),
            )
    return need, why


def pick_lru(
    inv: Inventory,
    need: int,
    now: float,
    protect: float,
    gone_digests: AbstractSet[int] = frozenset(),
) -> tuple[float | None, int, int, int]:
    """The last-use cutoff that frees ``need`` bytes, oldest blocks first,
    skipping blocks used within ``protect`` seconds and blocks of digests
    already removed. Returns (cutoff or None, blocks, bytes they hold,
    bytes still short)."""
    import numpy as np  # only when capacity asks for something

    if need <= 0 or not len(inv.lru_used):
        return None, 0, 0, max(need, 0)
    used = np.frombuffer(inv.lru_used, dtype=np.float64)
    sizes = np.frombuffer(inv.lru_bytes, dtype=np.int64)
    allowed = (now - used) >= protect
    if gone_digests:
        digest_of = np.frombuffer(inv.dir_digest, dtype=np.int64)[
            np.frombuffer(inv.lru_dir, dtype=np.int64)
        ]
        allowed &= ~np.isin(digest_of, np.fromiter(gone_digests, dtype=np.int64))
    used, sizes = used[allowed], sizes[allowed]
    if not len(used):
        return None, 0, 0, need
    order = np.argsort(used, kind="stable")
    cumulative = np.cumsum(sizes[order])
    index = int(np.searchsorted(cumulative, need))
    if index >= len(order):
        return float(used[order[-1]]), len(order), int(cumulative[-1]), need - int(cumulative[-1])
    return float(used[order[index]]), index + 1, int(cumulative[index]), 0
