"""Moving a bad block file aside, into its rank directory's ``.quarantine/``,
so that no lookup finds it again. The engine does it when a load finds a bad
file (``quarantine_at``: both directories resolved beneath its root),
``llmkv-fs verify --repair`` for every bad file it finds
(``move_to_quarantine``: both directories opened below the rank directory
it listed). Either way the move is one rename from one directory descriptor
to the other, never through a symlink, while live tiers write the volume,
so a file republished meanwhile is left alone. Stateless: any thread may
call it.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from llmkv_fs.layout.names import QUARANTINE_DIRNAME, quarantine_path
from llmkv_fs.volume.beneath import (
    ALREADY_THERE,
    DIR_FLAGS,
    Beneath,
    LinkInTree,
    make_dir_at,
    open_child_dir,
    open_path_beneath,
)
from llmkv_fs.volume.files import DEFAULT_DIR_MODE

__all__ = ["file_ident", "move_to_quarantine", "quarantine_at"]


def file_ident(st: os.stat_result) -> tuple[int, int]:
    """(st_dev, st_ino): which file a path named when it was judged."""
    return st.st_dev, st.st_ino


def move_to_quarantine(
    path: str, rank_dir: str, reason: str, ident: tuple[int, int] | None = None
) -> str | None:
    """Move the block file at ``path`` (below ``rank_dir`` by its spelling)
    to ``<name>.<reason>.<ns>`` in ``rank_dir``'s quarantine -- only while
    ``path`` still names ``ident`` (``file_ident`` of the file judged bad;
    None: whatever is there now). For the volume tools, which have no
    settings: a quarantine directory they make gets the rank directory's
    mode and, when we are root, its owner, so the tiers that share the
    volume can still write there.

    Returns the new path, or None when ``path`` names another file by now
    (a writer republished the block meanwhile: left where it is). Raises
    IsADirectoryError for a directory (a tree is never moved aside),
    FileNotFoundError when nothing is there any more, LinkInTree for a
    symlink on the way below ``rank_dir``, and any other OSError when the
    move failed.
    """
    parent, name = os.path.split(path)
    dir_fd = open_path_beneath(rank_dir, parent)
    try:
        rank_fd = open_path_beneath(rank_dir, rank_dir)
        try:
            return _move_aside(dir_fd, name, rank_fd, rank_dir, reason, ident, None)
        finally:
            os.close(rank_fd)
    finally:
        os.close(dir_fd)


def quarantine_at(
    below: Beneath,
    rank_rel: str,
    dir_fd: int,
    name: str,
    reason: str,
    ident: tuple[int, int] | None = None,
    dir_mode: int = DEFAULT_DIR_MODE,
) -> str | None:
    """``move_to_quarantine`` for a running tier: the bad file is ``name`` in
    the directory open as ``dir_fd`` (resolved beneath the root by the
    caller), the quarantine is ``.quarantine`` (made with ``dir_mode``) in
    the rank directory ``rank_rel`` resolved beneath the root too. Same
    answers as move_to_quarantine; the new path is for the log."""
    rank_fd = below.open_dir(rank_rel, create=True, dir_mode=dir_mode)
    try:
        rank_shown = f"{below.path}/{rank_rel}"
        return _move_aside(dir_fd, name, rank_fd, rank_shown, reason, ident, dir_mode)
    finally:
        os.close(rank_fd)


def _move_aside(
    dir_fd: int,
    name: str,
    rank_fd: int,
    rank_shown: str,
    reason: str,
    ident: tuple[int, int] | None,
    dir_mode: int | None,
) -> str | None:
    """The move itself: ``name`` in ``dir_fd`` into the quarantine of the
    rank directory open as ``rank_fd`` (``rank_shown`` is its path, for the
    answer and errors). ``dir_mode`` None: the rank directory's mode and
    owner (``move_to_quarantine``)."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if ident is not None and file_ident(st) != ident:
        return None
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "a directory is never moved aside", name)
    target = quarantine_path(rank_shown, name, reason, time.time_ns())
    qname = os.path.basename(target)
    qfd = _open_quarantine(rank_fd, f"{rank_shown}/{QUARANTINE_DIRNAME}", dir_mode)
    try:
        os.rename(name, qname, src_dir_fd=dir_fd, dst_dir_fd=qfd)
        if file_ident(os.stat(qname, dir_fd=qfd, follow_symlinks=False)) != file_ident(st):
            # A store published a fresh file between our lstat and rename.
            # Names are content keys, so putting it back is always right.
            os.rename(qname, name, src_dir_fd=qfd, dst_dir_fd=dir_fd)
            return None
    finally:
        os.close(qfd)
    return target


def _open_quarantine(rank_fd: int, shown: str, dir_mode: int | None) -> int:
    """A descriptor of the rank directory's real quarantine directory, made
    if needed (``dir_mode`` None: with the rank directory's mode, and its
    owner when we are root). Anything else at its name (a planted symlink,
    a file) is unlinked -- never followed -- and the directory made."""
    owner = None
    if dir_mode is None:
        rank = os.fstat(rank_fd)
        dir_mode = stat.S_IMODE(rank.st_mode)
        owner = (rank.st_uid, rank.st_gid) if os.geteuid() == 0 else None
    for _attempt in range(3):
        made = make_dir_at(rank_fd, QUARANTINE_DIRNAME, dir_mode, shown)
        if made != ALREADY_THERE and owner is not None:
            # By name without following: a link swapped in meanwhile is
            # what changes owner, never what it points to.
            os.chown(QUARANTINE_DIRNAME, *owner, dir_fd=rank_fd, follow_symlinks=False)
        if made >= 0:
            return made
        try:
            return open_child_dir(rank_fd, QUARANTINE_DIRNAME, DIR_FLAGS, shown)
        except FileNotFoundError:
            continue  # removed meanwhile: make it again
        except (LinkInTree, NotADirectoryError):
            os.unlink(QUARANTINE_DIRNAME, dir_fd=rank_fd)
    return open_child_dir(rank_fd, QUARANTINE_DIRNAME, DIR_FLAGS, shown)
