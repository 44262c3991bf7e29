"""Moving a bad block file aside, into its rank directory's ``.quarantine/``,
so that no lookup finds it again. The engine does it when a load finds a bad
file (``quarantine_at``: everything resolved beneath the root, so a file is
never moved out of a directory reached through a symlink), ``llmkv-fs verify
--repair`` for every bad file it finds (``move_to_quarantine``, by path);
both while live tiers write the volume, so a file republished meanwhile is
left alone. Stateless: any thread may call it.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from llmkv_fs.layout.names import QUARANTINE_DIRNAME, quarantine_dir, quarantine_path
from llmkv_fs.volume.beneath import Beneath
from llmkv_fs.volume.files import DEFAULT_DIR_MODE, make_dirs
from llmkv_fs.volume.nofollow import DIR_FLAGS, LinkInTree, make_dir_at, open_child_dir

__all__ = ["file_ident", "make_quarantine_dir", "move_to_quarantine", "quarantine_at"]


def file_ident(st: os.stat_result) -> tuple[int, int]:
    """(st_dev, st_ino): which file a path named when it was judged."""
    return st.st_dev, st.st_ino


def make_quarantine_dir(rank_dir: str, dir_mode: int | None = None) -> str:
    """Create ``rank_dir``'s quarantine directory if needed; returns its
    path. ``dir_mode`` None (the ops tools, which have no settings): the
    rank directory's mode and, when we are root, its owner, so the tiers
    that share the volume can still write there. By path, for the ops
    tools (a running tier quarantines beneath its root: ``quarantine_at``)."""
    qdir = quarantine_dir(rank_dir)
    if dir_mode is not None:
        try:
            make_dirs(qdir, dir_mode)
        except (NotADirectoryError, FileExistsError):
            pass  # something else holds the name: the caller's open says what
        return qdir
    if os.path.lexists(qdir):
        return qdir
    st = os.stat(rank_dir)
    make_dirs(qdir, stat.S_IMODE(st.st_mode))
    if os.geteuid() == 0:
        os.chown(qdir, st.st_uid, st.st_gid)
    return qdir


def move_to_quarantine(
    path: str,
    rank_dir: str,
    reason: str,
    ident: tuple[int, int] | None = None,
    dir_mode: int | None = None,
) -> str | None:
    """Move the block file at ``path`` to ``<name>.<reason>.<ns>`` in
    ``rank_dir``'s quarantine -- only while ``path`` still names ``ident``
    (``file_ident`` of the file judged bad; None: whatever is there now).

    Returns the new path, or None when ``path`` names another file by now
    (a writer republished the block meanwhile: left where it is). Raises
    IsADirectoryError for a directory (a tree is never moved aside),
    FileNotFoundError when nothing is there any more, and any other OSError
    when the move failed.
    """
    st = os.lstat(path)
    if ident is not None and file_ident(st) != ident:
        return None
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "a directory is never moved aside", path)
    qfd = _open_quarantine_dir(rank_dir, dir_mode)
    try:
        # Relative to the directory's fd: a link planted at .quarantine
        # meanwhile cannot redirect the move off the volume.
        target = quarantine_path(rank_dir, os.path.basename(path), reason, time.time_ns())
        name = os.path.basename(target)
        os.rename(path, name, dst_dir_fd=qfd)
        if file_ident(os.lstat(name, dir_fd=qfd)) != file_ident(st):
            # A store published a fresh file between our lstat and rename.
            # Names are content keys, so putting it back is always right.
            os.rename(name, path, src_dir_fd=qfd)
            return None
    finally:
        os.close(qfd)
    return target


def _open_quarantine_dir(rank_dir: str, dir_mode: int | None) -> int:
    """An fd of the real quarantine directory, created if needed. Anything
    else at its name (a planted symlink, a file) is unlinked -- never
    followed -- and the directory made."""
    qdir = quarantine_dir(rank_dir)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    for _attempt in range(3):
        make_quarantine_dir(rank_dir, dir_mode)
        try:
            return os.open(qdir, flags)
        except FileNotFoundError:
            continue  # removed meanwhile: make it again
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
        if not stat.S_ISDIR(os.lstat(qdir).st_mode):
            os.unlink(qdir)
    return os.open(qdir, flags)


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
    caller), the quarantine is ``.quarantine`` in the rank directory
    ``rank_rel`` resolved beneath the root too, and the rename goes from one
    descriptor to the other -- no file is ever moved out of, or into, a
    directory reached through a symlink. Same answers as move_to_quarantine;
    the new path is for the log."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if ident is not None and file_ident(st) != ident:
        return None
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "a directory is never moved aside", name)
    target = quarantine_path(f"{below.path}/{rank_rel}", name, reason, time.time_ns())
    qname = os.path.basename(target)
    qfd = _open_quarantine_at(below, rank_rel, dir_mode)
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


def _open_quarantine_at(below: Beneath, rank_rel: str, dir_mode: int) -> int:
    """A descriptor of the rank directory's real quarantine directory, made
    if needed. Anything else at its name (a planted symlink, a file) is
    unlinked -- never followed -- and the directory made. A symlinked rank
    directory raises LinkInTree (nothing is touched)."""
    rank_fd = below.open_dir(rank_rel, create=True, dir_mode=dir_mode)
    shown = f"{below.path}/{rank_rel}/{QUARANTINE_DIRNAME}"
    try:
        for _attempt in range(3):
            made = make_dir_at(rank_fd, QUARANTINE_DIRNAME, dir_mode, shown)
            if made >= 0:
                return made
            try:
                return open_child_dir(rank_fd, QUARANTINE_DIRNAME, DIR_FLAGS, shown)
            except FileNotFoundError:
                continue  # removed meanwhile: make it again
            except (LinkInTree, NotADirectoryError):
                os.unlink(QUARANTINE_DIRNAME, dir_fd=rank_fd)
        return open_child_dir(rank_fd, QUARANTINE_DIRNAME, DIR_FLAGS, shown)
    finally:
        os.close(rank_fd)
