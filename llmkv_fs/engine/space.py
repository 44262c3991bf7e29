"""The space guard: stop storing before the shared volume is full.

Threading: ``sample`` runs on the housekeeping thread (statvfs can block on a
network filesystem); ``allows_store`` is read by the owner when a store is
submitted and ``saw_enospc`` is called by I/O threads. State is a few plain
attributes, each replaced atomically; a decision one sample old is fine.
"""

from __future__ import annotations

from llmkv_fs.layout.fsinfo import VolumeUsage, volume_usage

__all__ = ["SpaceGuard"]


class SpaceGuard:
    """Refuses stores while the volume is above ``max_usage_percent`` or has
    less than ``min_free_bytes`` free. ENOSPC trips it too, and then it stays
    tripped until free space grows by ``headroom_bytes`` beyond what was left
    right after the failure -- someone (gc) must have made room, or every
    writer would hit ENOSPC again at once."""

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
        self._free_after_enospc: int | None = None

    def allows_store(self) -> bool:
        return not self._full

    @property
    def reason(self) -> str:
        if not self._full:
            return "ok"
        return "ENOSPC" if self._enospc else "watermark"

    def saw_enospc(self) -> None:
        self._free_after_enospc = None
        self._enospc = True
        self._full = True

    def sample(self) -> VolumeUsage:
        usage = volume_usage(self.path)
        self.usage = usage
        over = usage.used_percent > self.max_usage_percent or usage.free_bytes < self.min_free_bytes
        if self._enospc:
            if self._free_after_enospc is None:
                self._free_after_enospc = usage.free_bytes
            elif usage.free_bytes >= self._free_after_enospc + self.headroom_bytes:
                self._enospc = False
        self._full = over or self._enospc
        return usage
