"""The list of roots of a sharded tier (``path_sharding: "by_block_hash"``,
the keys of vLLM's open multi-root PR): ``root_dir`` as directories
separated by commas, split and checked here -- first by spelling
(``split_root_list``: empty, repeated or nested entries, too many), then
against the filesystem (``check_roots_distinct``: two entries that are one
directory through a symlink or a bind mount, or nested once links are
resolved; an entry that does not exist yet is judged by its nearest existing
ancestor). Both run before anything is created. The tier, the engine and the
volume tools all split and check the list here, so they agree on it; the
name a root is placed by is ``root_identity``.

Stateless: safe from any thread. ``check_roots_distinct`` stats and
resolves paths (start-up only, never on the scheduler thread).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from llmkv_fs.checks import TierConfigError

__all__ = [
    "MAX_ROOTS",
    "RootListError",
    "check_roots_distinct",
    "first_overlap",
    "root_identity",
    "split_root_list",
]

# Every root costs a housekeeping thread, a shared page and a lease; 64 is
# far past any server's count of drives or exports.
MAX_ROOTS = 64


class RootListError(TierConfigError):
    """An entry of a root list is empty, repeated, nested in another, or the
    list is too long. The message names the entry."""


def root_identity(root: str) -> str:
    """The name a root is placed by (``layout.placement``): its spelling with
    "." components, doubled and trailing slashes removed. Every replica must
    list the same directories under these names (the order is free)."""
    return os.path.normpath(root)


def split_root_list(key: str, text: str) -> tuple[str, ...]:
    """The entries of ``text`` (whitespace around each is dropped), in their
    order. Raises RootListError naming the entry: an empty one, one that
    repeats an earlier one by its spelling, one that lies inside another
    (by spelling, relative entries taken from the current directory), more
    than MAX_ROOTS."""
    entries = [entry.strip() for entry in text.split(",")]
    for position, entry in enumerate(entries, 1):
        if not entry:
            raise RootListError(
                f"llmkv_fs: {key} {text!r}: entry {position} is empty (list directories "
                f'separated by single commas: "/mnt/a/kv,/mnt/b/kv")'
            )
    if len(entries) > MAX_ROOTS:
        raise RootListError(
            f"llmkv_fs: {key} lists {len(entries)} directories; at most {MAX_ROOTS} are allowed"
        )
    absolute = [os.path.abspath(entry) for entry in entries]
    overlap = first_overlap(absolute)
    if overlap is not None:
        kind, first, second = overlap
        if kind == "same":
            raise RootListError(
                f"llmkv_fs: {key}: entry {first + 1} {entries[first]!r} names the same "
                f"directory as entry {second + 1} {entries[second]!r}; list each root once"
            )
        raise RootListError(
            f"llmkv_fs: {key}: entry {first + 1} {entries[first]!r} lies inside entry "
            f"{second + 1} {entries[second]!r}; roots must be separate directory trees "
            f"(gc of one would see the other's files as its own)"
        )
    return tuple(entries)


def first_overlap(
    paths: Sequence[str], same: Callable[[int, int], bool] | None = None
) -> tuple[str, int, int] | None:
    """The first two of ``paths`` (absolute, normalised) that overlap, later
    entries against earlier ones: ``("same", later, earlier)`` when equal (or
    ``same(later, earlier)`` says so), ``("inside", inner, outer)`` when one
    lies below the other; None when they are separate trees."""
    for later in range(len(paths)):
        for earlier in range(later):
            if paths[later] == paths[earlier] or (same is not None and same(later, earlier)):
                return ("same", later, earlier)
            for inner, outer in ((later, earlier), (earlier, later)):
                if paths[inner].startswith(paths[outer].rstrip("/") + "/"):
                    return ("inside", inner, outer)
    return None


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
