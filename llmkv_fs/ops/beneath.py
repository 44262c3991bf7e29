"""Opening directories below a top directory one name at a time, each
relative to its parent's fd and ``O_NOFOLLOW``.

Two reasons. A path string reaches any symlink planted in one of its
components (anyone who can write the volume can swap a directory for a link
between a listing and the next call), and the kernel refuses a path longer
than PATH_MAX (4096 bytes) outright, so a junk chain of long names below a
rank directory cannot be read, pruned or even ``lstat``-ed by path. Opened
name by name, a link anywhere is ELOOP or ENOTDIR -- never followed -- and
no call sees more than one name.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["DIR_FLAGS", "MAX_DEPTH", "DirHandles", "open_beneath", "open_dir"]

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# How deep below a top the tools descend. The layout goes 2 levels down
# (<hhh>/<hh>_g<g>); anything deeper is foreign, and each level read costs an
# open fd while its children are read.
MAX_DEPTH = 32


def open_dir(name: str, dir_fd: int | None = None) -> int:
    """An fd of the directory ``name`` (relative to ``dir_fd`` if given).
    A symlink there is ELOOP ("a symlink, not followed"), whichever of
    ELOOP and ENOTDIR the kernel chose; anything else not a directory is
    ENOTDIR."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR) or not _is_link(name, dir_fd):
            raise
        raise OSError(errno.ELOOP, "a symlink, not followed", name) from exc


def _is_link(name: str, dir_fd: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def open_beneath(top: str, path: str) -> int:
    """An fd of directory ``path``, which lies at or below ``top``: ``top``
    is opened by its path (``O_NOFOLLOW``: a top that is a link is
    refused), every component after it relative to the one before."""
    if path != top and not path.startswith(top + "/"):
        raise ValueError(f"{path!r} is not below {top!r}")
    fd = open_dir(top)
    rest = path[len(top) + 1 :] if path != top else ""
    for name in rest.split("/") if rest else ():
        try:
            child = open_dir(name, fd)
        finally:
            os.close(fd)
        fd = child
    return fd


class DirHandles:
    """The fd of the directory acted in last, kept open while the next
    action is in the same one (eviction in age order visits a directory's
    same-age blocks one after another). Not thread-safe; close() when done."""

    def __init__(self) -> None:
        self._path: str | None = None
        self._fd = -1

    def get(self, top: str, path: str) -> int:
        if path != self._path:
            self.close()
            self._fd = open_beneath(top, path)
            self._path = path
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._path, self._fd = None, -1

    def __enter__(self) -> DirHandles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
