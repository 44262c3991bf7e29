"""The filesystem holding the volume: its type and mount point (from the
mount table) and how full it is (statvfs). Read-only questions to the
kernel, safe from any thread -- but statvfs can block on a network
filesystem, so the engine asks it on its housekeeping thread only.
"""

from __future__ import annotations

import dataclasses
import os
import re

__all__ = [
    "MOUNTS_FILE",
    "Mount",
    "VolumeUsage",
    "filesystem_type",
    "mount_of",
    "parse_mounts",
    "read_mounts",
    "volume_usage",
]

MOUNTS_FILE = "/proc/self/mounts"


@dataclasses.dataclass(frozen=True)
class VolumeUsage:
    total_bytes: int
    used_bytes: int
    free_bytes: int  # available to unprivileged writers (f_bavail)
    inodes: int = 0
    inodes_free: int = 0

    @property
    def usable_bytes(self) -> int:
        """used + available: the size ``df`` shows (the root reserve excluded)."""
        return self.used_bytes + self.free_bytes

    @property
    def used_percent(self) -> float:
        return used_percent(self.used_bytes, self.usable_bytes)


def used_percent(used: int, usable: int) -> float:
    """A volume's use as ``df`` shows it: used / (used + available to
    non-root), the root reserve excluded. The one definition the space
    guard, gc and stats print and act on; an empty volume (no usable bytes)
    counts as full here (gc's ``Capacity`` takes it as 0 % and never evicts
    for it)."""
    return 100.0 * used / usable if usable else 100.0


def volume_usage(path: str) -> VolumeUsage:
    """statvfs of the filesystem holding ``path``; OSError passes through."""
    st = os.statvfs(path)
    return VolumeUsage(
        total_bytes=st.f_blocks * st.f_frsize,
        used_bytes=(st.f_blocks - st.f_bfree) * st.f_frsize,
        free_bytes=st.f_bavail * st.f_frsize,
        inodes=st.f_files,
        inodes_free=st.f_ffree,
    )


@dataclasses.dataclass(frozen=True)
class Mount:
    device: str
    mount_point: str
    fstype: str


# The kernel writes a space, tab, newline or backslash inside a mount-table
# field as a 3-digit octal escape (\040, \011, \012, \134).
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mounts(text: str) -> list[Mount]:
    """The mounts of a ``/proc/self/mounts`` text, in its order."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            mounts.append(Mount(*(_unescape(f) for f in fields[:3])))
    return mounts


def read_mounts(path: str = MOUNTS_FILE) -> list[Mount]:
    """This process's mount table; [] when it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return parse_mounts(f.read())
    except OSError:
        return []


def mount_of(path: str, mounts: list[Mount] | None = None) -> Mount | None:
    """The mount holding ``path`` (symlinks resolved): the longest mount point
    containing it, of equal ones the last (a later mount shadows an earlier
    one). ``mounts`` defaults to this process's table."""
    real = os.path.realpath(path)
    best: Mount | None = None
    for mount in read_mounts() if mounts is None else mounts:
        point = mount.mount_point
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.mount_point)):
            best = mount
    return best


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding ``path`` (e.g. "tmpfs",
    "fuse.glusterfs"), or "" when the mount table cannot tell."""
    mount = mount_of(path)
    return mount.fstype if mount is not None else ""
