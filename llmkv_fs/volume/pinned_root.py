"""The cache root a running tier is pinned to, and how a path below it is
named component by component. Immutable values; any thread may use them.
"""

from __future__ import annotations

import dataclasses
import errno
import os

__all__ = ["PinnedRoot", "RootLost", "parts_below"]


class RootLost(OSError):
    """The cache root is missing, or is no longer the directory the tier
    started on (the volume was unmounted, or the directory replaced).
    Deliberately not a FileNotFoundError: callers retry those by creating
    the parent, and the root is the one directory never created while
    running."""


def parts_below(root: str, path: str) -> list[str]:
    """The components of ``path`` below ``root`` ("." and empty ones
    dropped). ValueError unless ``path`` lies strictly below ``root`` by its
    spelling: a ".." anywhere is refused, never resolved."""
    top = root.rstrip("/")
    if not path.startswith(top + "/"):
        raise ValueError(f"{path!r} is not below the root {root!r}")
    parts = [p for p in path[len(top) :].split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise ValueError(f"{path!r} is not strictly below the root {root!r}")
    return parts


@dataclasses.dataclass(frozen=True)
class PinnedRoot:
    """The root directory as found when the tier started: its path and
    ``(st_dev, st_ino)``. Directory creation while running stops below it
    (``Beneath.open_dir(create=True)``, volume/beneath.py), so an unmounted volume never becomes
    a fresh cache on the disk underneath the mount point. Immutable; any
    thread may use it."""

    path: str
    ident: tuple[int, int]

    @classmethod
    def pin(cls, path: str) -> PinnedRoot:
        st = os.stat(path)
        return cls(path, (st.st_dev, st.st_ino))

    def is_current(self) -> bool:
        """Whether ``path`` still names the pinned directory (one stat: may
        block on a network filesystem; call it off the scheduler thread)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ident

    def lost(self) -> RootLost:
        return RootLost(
            errno.ENOENT,
            "root_dir is missing or is no longer the directory the tier started "
            "on (volume unmounted?); not recreated",
            self.path,
        )

    def check(self) -> None:
        """Raise RootLost unless ``path`` still names the pinned directory."""
        if not self.is_current():
            raise self.lost()

    def levels(self, path: str) -> list[str]:
        """The directories from the root's child down to ``path`` (which must
        lie strictly below the root), shallowest first."""
        top = self.path.rstrip("/")
        parts = parts_below(self.path, path)
        return [f"{top}/{'/'.join(parts[: i + 1])}" for i in range(len(parts))]
