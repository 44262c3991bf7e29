"""The space guard: stop storing before the shared volume is full.

Threading: ``sample`` runs on the housekeeping thread (statvfs can block on a
network filesystem); ``allows_store`` is read by the owner when a store is
submitted and ``saw_enospc`` is called by I/O threads. The ENOSPC state
(tripped, and free space at the failure) changes under a small lock, never
held across a statvfs; ``allows_store`` reads one attribute without it. A
decision one sample old is fine.
"""

from __future__ import annotations

import threading

from llmkv_fs.layout.fsinfo import VolumeUsage, volume_usage

__all__ = ["SpaceGuard"]


class SpaceGuard:
    """Refuses stores while the volume is above ``max_usage_percent`` or has
    less than ``min_free_bytes`` free. ENOSPC trips it too, and then it stays
    tripped until free space grows by ``headroom_bytes`` beyond what was free
    at the failure -- someone (gc) must have made room, or every writer would
    hit ENOSPC again at once.

    The baseline is measured by the thread that saw ENOSPC, right then: taken
    at the next sample instead (up to a second later), it would include room
    freed meanwhile, and the guard would wait for that much more again --
    possibly for good."""

    def __init__(
        self, path: str, max_usage_percent: float, min_free_bytes: int, headroom_bytes: int
    ):
        self.path = path
        self.max_usage_percent = max_usage_percent
        self.min_free_bytes = min_free_bytes
        self.headroom_bytes = headroom_bytes
        self.usage: VolumeUsage | None = None
        self._full = False
        self._enospc = False
        self._free_at_enospc: int | None = None  # None: measure at the next sample
        self._lock = threading.Lock()

    def allows_store(self) -> bool:
        return not self._full

    @property
    def reason(self) -> str:
        if not self._full:
            return "ok"
        return "ENOSPC" if self._enospc else "watermark"

    def saw_enospc(self) -> None:
        """A write failed with ENOSPC/EDQUOT (I/O thread): trip, with what is
        free now as the baseline."""
        try:
            free: int | None = volume_usage(self.path).free_bytes
        except OSError:
            free = None  # the next sample measures it
        with self._lock:
            self._free_at_enospc = free
            self._enospc = True
            self._full = True

    def sample(self) -> VolumeUsage:
        usage = volume_usage(self.path)
        self.usage = usage
        over = usage.used_percent > self.max_usage_percent or usage.free_bytes < self.min_free_bytes
        with self._lock:
            if self._enospc:
                if self._free_at_enospc is None:
                    self._free_at_enospc = usage.free_bytes
                elif usage.free_bytes >= self._free_at_enospc + self.headroom_bytes:
                    self._enospc = False
            self._full = over or self._enospc
        return usage
