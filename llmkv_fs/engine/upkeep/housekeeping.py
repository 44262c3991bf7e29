"""The housekeeping thread: everything periodic that touches the volume but
belongs to no transfer -- checking that root_dir is still the directory the
tier started on, sampling free space for the space guard, writing and
refreshing this tier's lease, and warning when live replicas of the same
digest hash blocks differently (they would never share a block).

Threading: one daemon thread owns the lease file, stats the root, calls
``SpaceGuard.sample`` and applies queued access stamps (``stamp``, a
callable from the engine). It alone writes ``root_lost`` (a byte of the
shared ``VolumeSignals`` page the owner and the I/O workers read without a
lock: the stat that may hang on a dead network volume never runs on the
scheduler thread). The owner only calls ``set_lease`` (hands a
Lease over, returns at once), ``stop_soon`` (returns at once) and ``stop``
(waits a bounded time). The thread never dies of an exception: each round's
failure is counted in ``errors``, logged (throttled) and the next round runs
as usual -- a dead thread would mean no lease refresh, no access stamps and
a space guard that never lifts.

Stopping: the thread itself applies the last access stamps and removes the
lease on its way out, so no call on the volume runs on the owner's thread.
``stop`` waits for that at most ``wait_s``; a thread still inside a call on
a volume that does not answer is left behind (a daemon thread: it finishes
its way out if the volume answers, and never starts another round) and the
log names what it leaves: the lease file, which gc takes for dead once it
is ``STALE_AFTER_INTERVALS`` lease intervals old, or at once from this host
when this process has exited (``Lease.is_live``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from llmkv_fs.engine.upkeep.space import SpaceGuard
from llmkv_fs.volume.files import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE
from llmkv_fs.volume.leases import (
    STALE_AFTER_INTERVALS,
    Lease,
    read_leases,
    refresh_lease,
    remove_lease,
    write_lease,
)
from llmkv_fs.volume.pinned_root import PinnedRoot

__all__ = ["Housekeeping"]

logger = logging.getLogger("vllm.llmkv_fs.housekeeping")

SPACE_SAMPLE_INTERVAL_S = 1.0
# How long ``stop`` waits by default: a metadata call that has not answered
# in this long means the volume is not answering (the engine passes its
# lookup deadline, min(job_timeout_s, this)).
STOP_WAIT_S = 5.0
# One traceback per this many seconds at most: a failure that repeats every
# round must not flood the log.
ERROR_LOG_INTERVAL_S = 60.0


class Housekeeping:
    def __init__(
        self,
        guard: SpaceGuard,
        digest_dir: str,
        lease_interval_s: float,
        file_mode: int = DEFAULT_FILE_MODE,
        dir_mode: int = DEFAULT_DIR_MODE,
        stamp: Callable[[], int] | None = None,
        root: PinnedRoot | None = None,
    ):
        self.guard = guard
        self.root = root
        self._stamp = stamp
        self.digest_dir = digest_dir
        self.lease_interval_s = lease_interval_s
        self._modes = (file_mode, dir_mode)
        self._wake = threading.Event()
        self._stopping = False
        self._stop_asked: float | None = None  # monotonic, when stop_soon was first called
        self._pending_lease: Lease | None = None
        self.lease: Lease | None = None
        self.lease_path: str | None = None
        self.other_fingerprints: frozenset[str] = frozenset()
        self._warned: frozenset[str] = frozenset()
        self.errors = 0
        self._last_error_log = -ERROR_LOG_INTERVAL_S
        self._sample_space()  # the guard starts with a real answer
        self._thread = threading.Thread(target=self._run, name="llmkv_fs_housekeeping", daemon=True)
        self._thread.start()

    def set_lease(self, lease: Lease) -> None:
        """Owner side: publish ``lease`` from the housekeeping thread."""
        self._pending_lease = lease
        self._wake.set()

    def stop_soon(self) -> None:
        """Owner side: tell the thread to finish (see the module doc);
        returns at once. Idempotent."""
        if self._stop_asked is None:
            self._stop_asked = time.monotonic()
        self._stopping = True
        self._wake.set()

    def stop(self, wait_s: float = STOP_WAIT_S) -> bool:
        """Owner side: ``stop_soon`` and wait at most ``wait_s`` for the
        thread to apply the last stamps and remove the lease. False if it is
        still inside a call on the volume then: left behind and logged."""
        self.stop_soon()
        self._thread.join(wait_s)
        if not self._thread.is_alive():
            return True
        lease, asked = self.lease, self._stop_asked
        assert asked is not None  # set by stop_soon
        logger.warning(
            "llmkv_fs: shutdown did not wait for the housekeeping thread of %s, still "
            "inside a call on the volume after %.1fs -- the volume is not answering; "
            "left behind: %s; its last access stamps are not applied. The thread "
            "applies them and removes the lease if the volume answers.",
            self.guard.path,
            time.monotonic() - asked,
            "no lease written yet"
            if self.lease_path is None or lease is None
            else (
                f"lease file {self.lease_path} (gc takes it for dead once it is "
                f"{STALE_AFTER_INTERVALS * lease.interval_s:.0f}s old, or at once from "
                "this host when this process has exited)"
            ),
        )
        return False

    def _run(self) -> None:
        next_lease = 0.0
        # Wake often enough for a short lease interval too: a lease refreshed
        # less often than its interval would look dead to gc and peers.
        tick = min(SPACE_SAMPLE_INTERVAL_S, self.lease_interval_s / 2)
        while not self._stopping:
            self._wake.wait(tick)
            self._wake.clear()
            if self._stopping or not self._root_is_ours():
                continue  # nothing below touches a volume that is not ours
            for step in (self._sample_space, self._apply_stamps):
                if not self._stopping:
                    self._guarded(step)
            now = time.monotonic()
            if self._stopping:
                break
            if self._pending_lease is not None or (self.lease is not None and now >= next_lease):
                self._guarded(self._tend_lease)
                next_lease = now + self.lease_interval_s
        self._guarded(self._apply_stamps)  # a failed stamp is skipped
        self._guarded(self._remove_lease)

    def _remove_lease(self) -> None:
        if self.lease_path is not None:
            if not remove_lease(self.lease_path, self.root):
                logger.warning(
                    "llmkv_fs: could not remove lease %s; it will go stale", self.lease_path
                )
            self.lease_path = None

    def _root_is_ours(self) -> bool:
        """Re-check the root; log once when it is lost and once when back."""
        if self.root is None:
            return True
        # The verdict lives in the guard's shared page (VolumeSignals), the
        # one place the engine and its I/O workers read it from.
        signals = self.guard.signals
        current = self.root.is_current()
        if self._stopping:  # answered after stop: the engine is gone, say nothing
            return False
        if current == (not signals.root_lost):
            return current
        # Logged before the verdict is published: whoever sees the gauge or a
        # refused store can already find the line that says why (a test that
        # waited on the gauge once missed the "is back" line, logged after it).
        if not current:
            logger.error(
                "llmkv_fs: root_dir %s is missing or is no longer the directory this "
                "tier started on (volume unmounted?). The volume is failed: stores are "
                "refused, lookups miss, loads fail, and nothing is created there. "
                "Mount the volume again; the tier resumes by itself when the original "
                "directory is back (after a remount that gives it a new device, "
                "restart the replica).",
                self.root.path,
            )
        else:
            logger.warning(
                "llmkv_fs: root_dir %s is back; the volume is in use again", self.root.path
            )
        signals.root_lost = not current
        return current

    def _guarded(self, step: Callable[[], object]) -> None:
        """``step()``; any exception is counted and logged (throttled), never
        fatal to the thread."""
        try:
            step()
        except Exception:
            self.errors += 1
            now = time.monotonic()
            if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
                self._last_error_log = now
                logger.exception(
                    "llmkv_fs: housekeeping step %s failed (%d errors so far; "
                    "logged at most every %.0fs); carrying on",
                    getattr(step, "__name__", step),
                    self.errors,
                    ERROR_LOG_INTERVAL_S,
                )

    def _apply_stamps(self) -> None:
        if self._stamp is not None:
            self._stamp()

    def _sample_space(self) -> None:
        try:
            self.guard.sample()
        except OSError as exc:
            self.errors += 1
            logger.warning("llmkv_fs: statvfs of %s failed: %r", self.guard.path, exc)

    def _tend_lease(self) -> None:
        try:
            if self._pending_lease is not None:
                self.lease, self._pending_lease = self._pending_lease, None
                self.lease_path = write_lease(
                    self.digest_dir, self.lease, *self._modes, root=self.root
                )
            elif self.lease is not None and (
                self.lease_path is None or not refresh_lease(self.lease_path, self.root)
            ):
                # Never written (the first write failed), or gc judged us dead
                # (a long stall?): say we are alive again.
                self.lease_path = write_lease(
                    self.digest_dir, self.lease, *self._modes, root=self.root
                )
            self._check_peers()
        except OSError as exc:
            self.errors += 1
            logger.warning("llmkv_fs: lease under %s not refreshed: %r", self.digest_dir, exc)

    def _check_peers(self) -> None:
        me = self.lease
        if me is None:
            return
        host = socket.gethostname()
        peers = [
            lease
            for lease in read_leases(self.digest_dir, self.root)
            if lease.is_live(this_host=host) and lease.path != self.lease_path
        ]
        differing = frozenset(
            lease.seed_fingerprint
            for lease in peers
            if (lease.seed_fingerprint, lease.hash_algo) != (me.seed_fingerprint, me.hash_algo)
        )
        self.other_fingerprints = differing
        if differing - self._warned:
            count = sum(lease.seed_fingerprint in differing for lease in peers)
            logger.warning(
                "llmkv_fs: this replica will not share cache with %d live replica(s) of "
                "%s: PYTHONHASHSEED or the prefix-caching hash algorithm differs "
                "(this replica: %s/%s; others: %s). Give every replica the same "
                "PYTHONHASHSEED and --prefix-caching-hash-algo.",
                count,
                self.digest_dir,
                me.hash_algo,
                me.seed_fingerprint,
                ", ".join(
                    sorted(
                        f"{lease.hash_algo}/{lease.seed_fingerprint}"
                        for lease in peers
                        if lease.seed_fingerprint in differing
                    )
                ),
            )
        self._warned = differing
