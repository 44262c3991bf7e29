"""The checks of a root list that need the filesystem: two entries that are
one directory (through a symlink, or a bind mount: compared by device and
inode) or one entry inside another once links are resolved. Run before
anything is created; an entry that does not exist yet is judged by its
nearest existing ancestor. The spelling checks come first
(``rootlist.split_root_list``).

Touches the filesystem (stat, realpath): call it at start-up, never on the
scheduler thread while running.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from llmkv_fs.rootlist import RootListError, first_overlap

__all__ = ["check_roots_distinct"]


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _resolved(path: str) -> str:
    """``path`` with its links resolved as far as it exists, the rest (what
    start-up would create) appended as spelled."""
    path = os.path.abspath(path)
    existing = _nearest_existing(path)
    rest = os.path.relpath(path, existing)
    real = os.path.realpath(existing)
    return real if rest == "." else os.path.join(real, rest)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def check_roots_distinct(key: str, roots: Sequence[str]) -> None:
    """Raise RootListError naming the entries when two roots are one
    directory (same device and inode: a symlink or bind mount) or one lies
    inside another after resolving links."""
    identities = [_identity(root) for root in roots]
    resolved = [_resolved(root) for root in roots]

    def same_inode(later: int, earlier: int) -> bool:
        return identities[later] is not None and identities[later] == identities[earlier]

    overlap = first_overlap(resolved, same_inode)
    if overlap is None:
        return
    kind, first, second = overlap
    if kind == "same":
        raise RootListError(
            f"llmkv_fs: {key}: entry {first + 1} {roots[first]!r} and entry {second + 1} "
            f"{roots[second]!r} are the same directory (a symlink or bind mount); list "
            f"each root once"
        )
    raise RootListError(
        f"llmkv_fs: {key}: entry {first + 1} {roots[first]!r} lies inside entry "
        f"{second + 1} {roots[second]!r} (resolved: {resolved[first]!r} in "
        f"{resolved[second]!r}); roots must be separate directory trees"
    )
