"""One directory level at a time, never through a symlink: a directory
opened or made relative to its parent's descriptor with
``O_NOFOLLOW|O_DIRECTORY``, and what is raised when a link or a mount point
stands where a directory of the cache tree belongs (``LinkInTree``,
``MountInTree``). ``volume/beneath.py`` builds the tier's walk beneath its
pinned root from these steps; the volume tools (gc, stats, verify) and the
ops-side quarantine use them directly, with ``open_path_beneath`` for a top
they listed by path. Why a path below the root is never handed to the
kernel whole: ``volume/beneath.py``.

Stateless: any thread may call these; the descriptors returned are the
caller's to close.
"""

from __future__ import annotations

import errno
import os
import stat

from llmkv_fs.volume.files import needs_chmod
from llmkv_fs.volume.pinned_root import parts_below

__all__ = [
    "ALREADY_THERE",
    "DIR_FLAGS",
    "MADE_HERE",
    "OPEN_DIR_FLAGS",
    "LinkInTree",
    "MountInTree",
    "make_dir_at",
    "open_child_dir",
    "open_path_beneath",
]

# A directory to resolve names in: no read permission needed, no open call
# into the filesystem; O_NOFOLLOW|O_DIRECTORY fail on a link (ENOTDIR).
DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A directory really opened: fsync, fchmod, listing, NFS close-to-open.
OPEN_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
AT_FDCWD = -100  # openat's "relative to the current directory" (Linux)


class LinkInTree(OSError):
    """A symlink where a directory of the cache tree belongs (below the
    root): never followed. errno ELOOP, so it keeps its meaning when it
    crosses a process boundary as a bare OSError."""


class MountInTree(LinkInTree):
    """A mount point where a directory of the cache tree belongs: another
    filesystem (or a bind mount) inside the root, never crossed. Handled
    as a link everywhere (errno ELOOP, counted ``link_in_tree``)."""

    def __init__(self, shown: str):
        super().__init__(errno.ELOOP, "a mount point, not crossed", shown)


def open_child_dir(
    parent_fd: int, name: str, flags: int = DIR_FLAGS, shown: str = "", must_read: bool = False
) -> int:
    """The directory ``name`` in ``parent_fd`` opened with ``flags`` (which
    hold ``O_NOFOLLOW|O_DIRECTORY``). LinkInTree for a symlink there,
    NotADirectoryError for anything else that is not a directory,
    FileNotFoundError when nothing is (``shown``, else ``name``, names it
    in errors). A directory that may be searched but not read is resolved
    only (``O_PATH``) unless ``must_read`` (a listing): PermissionError."""
    try:
        return os.open(name, flags, dir_fd=parent_fd)
    except PermissionError:
        if flags == DIR_FLAGS or must_read:
            raise
        # Searchable but not readable (another uid's directory): resolve it
        # only. A real open was only wanted for NFS freshness or listing.
        return open_child_dir(parent_fd, name, DIR_FLAGS, shown)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
    # Which of the two: one lstat, on this rare path only.
    mode = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
    shown = shown or name
    if stat.S_ISLNK(mode):
        raise LinkInTree(errno.ELOOP, "a symlink, not followed", shown)
    # A directory by now: another client's fresh mkdir became visible (a
    # caller creating retries that).
    raise NotADirectoryError(errno.ENOTDIR, "not a directory", shown)


# What make_dir_at answers when it hands back no descriptor (both < 0: the
# caller opens the directory): it was there already, or this call made it
# (then it is on its parent's device, no mount point).
ALREADY_THERE = -1
MADE_HERE = -2


def make_dir_at(parent_fd: int, name: str, dir_mode: int, shown: str = "") -> int:
    """mkdir ``name`` in ``parent_fd`` with exactly ``dir_mode``.
    ALREADY_THERE or MADE_HERE when the caller is to open it; a descriptor
    of it when making it needed a chmod (done through that descriptor: a
    chmod by name would follow a link swapped in meanwhile)."""
    try:
        os.mkdir(name, dir_mode, dir_fd=parent_fd)
    except FileExistsError:
        return ALREADY_THERE
    if not needs_chmod(dir_mode):
        return MADE_HERE
    fd = open_child_dir(parent_fd, name, OPEN_DIR_FLAGS, shown)
    try:
        os.fchmod(fd, dir_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_path_beneath(top: str, path: str) -> int:
    """A readable descriptor of the directory ``path``, which lies at or below
    ``top`` by its spelling: ``top`` opened by its path (a link there is
    refused too: LinkInTree), every component after it relative to the one
    before, never through a link. For the volume tools, which walk tops they
    listed a moment ago (a rank or digest directory) while live tiers write
    the volume; a running tier resolves beneath its pinned root (Beneath).
    ValueError when ``path`` is not ``top`` or below it."""
    if path != top and not path.startswith(top.rstrip("/") + "/"):
        raise ValueError(f"{path!r} is not below {top!r}")
    names = parts_below(top, path) if path != top else []
    fd = open_child_dir(AT_FDCWD, top, DIR_FLAGS if names else OPEN_DIR_FLAGS, must_read=True)
    shown = top.rstrip("/")
    for i, name in enumerate(names):
        shown = f"{shown}/{name}"
        flags = OPEN_DIR_FLAGS if i == len(names) - 1 else DIR_FLAGS
        try:
            child = open_child_dir(fd, name, flags, shown, must_read=True)
        finally:
            os.close(fd)
        fd = child
    return fd
