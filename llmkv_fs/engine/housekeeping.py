"""The housekeeping thread: everything periodic that touches the volume but
belongs to no transfer -- sampling free space for the space guard, writing
and refreshing this tier's lease, and warning when live replicas of the same
digest hash blocks differently (they would never share a block).

Threading: one daemon thread owns the lease file, calls
``SpaceGuard.sample`` and applies queued access stamps (``stamp``, a
callable from the engine). The owner only calls ``set_lease`` (hands a Lease
over, returns at once) and ``stop`` (joins; removes the lease).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from llmkv_fs.engine.space import SpaceGuard
from llmkv_fs.layout.files import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE
from llmkv_fs.layout.leases import Lease, read_leases, refresh_lease, remove_lease, write_lease

__all__ = ["Housekeeping"]

logger = logging.getLogger("vllm.llmkv_fs.housekeeping")

SPACE_SAMPLE_INTERVAL_S = 1.0


class Housekeeping:
    def __init__(
        self,
        guard: SpaceGuard,
        digest_dir: str,
        lease_interval_s: float,
        file_mode: int = DEFAULT_FILE_MODE,
        dir_mode: int = DEFAULT_DIR_MODE,
        stamp: Callable[[], int] | None = None,
    ):
        self.guard = guard
        self._stamp = stamp
        self.digest_dir = digest_dir
        self.lease_interval_s = lease_interval_s
        self._modes = (file_mode, dir_mode)
        self._wake = threading.Event()
        self._stopping = False
        self._pending_lease: Lease | None = None
        self.lease: Lease | None = None
        self.lease_path: str | None = None
        self.other_fingerprints: frozenset[str] = frozenset()
        self._warned: frozenset[str] = frozenset()
        self.errors = 0
        self._sample_space()  # the guard starts with a real answer
        self._thread = threading.Thread(target=self._run, name="llmkv_fs_housekeeping", daemon=True)
        self._thread.start()

    def set_lease(self, lease: Lease) -> None:
        """Owner side: publish ``lease`` from the housekeeping thread."""
        self._pending_lease = lease
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self._apply_stamps()  # never raises: a failed stamp is skipped
        if self.lease_path is not None:
            if not remove_lease(self.lease_path):
                logger.warning(
                    "llmkv_fs: could not remove lease %s; it will go stale", self.lease_path
                )
            self.lease_path = None

    def _run(self) -> None:
        next_lease = 0.0
        # Wake often enough for a short lease interval too: a lease refreshed
        # less often than its interval would look dead to gc and peers.
        tick = min(SPACE_SAMPLE_INTERVAL_S, self.lease_interval_s / 2)
        while not self._stopping:
            self._wake.wait(tick)
            self._wake.clear()
            if self._stopping:
                return
            self._sample_space()
            self._apply_stamps()
            now = time.monotonic()
            if self._pending_lease is not None or (self.lease is not None and now >= next_lease):
                self._tend_lease()
                next_lease = now + self.lease_interval_s

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
                self.lease_path = write_lease(self.digest_dir, self.lease, *self._modes)
            elif self.lease is not None and (
                self.lease_path is None or not refresh_lease(self.lease_path)
            ):
                # Never written (the first write failed), or gc judged us dead
                # (a long stall?): say we are alive again.
                self.lease_path = write_lease(self.digest_dir, self.lease, *self._modes)
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
            for lease in read_leases(self.digest_dir)
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
