"""The space guard: stop storing before the shared volume is full.

Threading and processes: ``sample`` runs on the housekeeping thread (statvfs
can block on a network filesystem); its verdict (``stores_refused`` of the
root's signals page) is read by the owner when a store is submitted and by
every block before it is stored;
``trip_on_enospc`` is called by whichever I/O thread or worker process hit
ENOSPC (block/blockio.py). The verdict lives in the shared ``VolumeSignals`` page, so a worker
process reads and trips the same guard (signals.py says how its one race
settles). A decision one sample old is fine.
"""

from __future__ import annotations

from llmkv_fs.engine.upkeep.signals import VolumeSignals
from llmkv_fs.volume.fsinfo import VolumeUsage, volume_usage

__all__ = ["SpaceGuard", "trip_on_enospc"]

# After ENOSPC, a 1/_IN_USE_SHARE of the bytes then in use coming free is
# enough to resume stores where the headroom is more (SpaceGuard's doc).
_IN_USE_SHARE = 10


def trip_on_enospc(signals: VolumeSignals, path: str) -> None:
    """A write on the volume of ``path`` failed with ENOSPC/EDQUOT: refuse
    stores, with what is free right now as the baseline (see SpaceGuard).
    Any thread or worker process that hit it calls this."""
    try:
        free: int | None = volume_usage(path).free_bytes
    except OSError:
        free = None  # the next sample measures it
    signals.trip_enospc(free)


class SpaceGuard:
    """Refuses stores while the volume is above ``max_usage_percent`` or has
    less than ``min_free_bytes`` free. ENOSPC trips it too, and then it stays
    tripped until free space grows by ``headroom_bytes`` beyond what was free
    at the failure -- someone (gc) must have made room, or every writer would
    hit ENOSPC again at once -- or by a tenth of the bytes in use at the
    failure (its usable size less the baseline), where that is less: gc's
    default band (``--high 85 --low 75``) frees a quarter of a full volume
    and stops, so on a volume with less than ten headrooms in use, waiting
    for the whole headroom would refuse stores for good. Stores after such a
    lift may meet ENOSPC again, which trips it again: a miss, never lost KV.
    At least one byte must come free: a volume whose numbers never move
    (nothing in use, nothing freed) is not retried every sample.

    The baseline is measured by the thread that saw ENOSPC, right then: taken
    at the next sample instead (up to a second later), it would include room
    freed meanwhile, and the guard would wait for that much more again --
    possibly for good.

    A block step (an I/O thread or a worker process) reads and trips the
    shared verdict through its root's ``VolumeSignals`` directly; this
    object belongs to the engine (the owner and the housekeeping thread)."""

    def __init__(
        self,
        path: str,
        max_usage_percent: float,
        min_free_bytes: int,
        headroom_bytes: int,
        signals: VolumeSignals | None = None,
    ):
        self.path = path
        self.max_usage_percent = max_usage_percent
        self.min_free_bytes = min_free_bytes
        self.headroom_bytes = headroom_bytes
        # Its own page when none is shared (tools and tests without workers).
        self.signals = signals if signals is not None else VolumeSignals.create()
        self.usage: VolumeUsage | None = None

    def allows_store(self) -> bool:
        return not self.signals.stores_refused

    @property
    def reason(self) -> str:
        return self.signals.refusal

    def room_needed(self, baseline: int, usage: VolumeUsage) -> int:
        """Bytes that must come free beyond ``baseline`` (free at ENOSPC)
        before stores resume: the headroom, or a tenth of the bytes in use
        at the failure where that is less; one at least (the class doc)."""
        in_use = max(0, usage.usable_bytes - baseline)
        return max(1, min(self.headroom_bytes, in_use // _IN_USE_SHARE))

    def sample(self) -> VolumeUsage:
        usage = volume_usage(self.path)
        self.usage = usage
        over = usage.used_percent > self.max_usage_percent or usage.free_bytes < self.min_free_bytes
        signals = self.signals
        if signals.enospc:
            baseline = signals.free_at_enospc()
            if baseline is None:
                signals.set_free_at_enospc(usage.free_bytes)
            elif usage.free_bytes >= baseline + self.room_needed(baseline, usage):
                signals.clear_enospc()
        signals.set_refused(over)
        return usage
