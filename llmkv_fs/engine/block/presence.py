"""Whether a block's file is there: a regular file of a size our reader
accepts, at the block's path resolved beneath the root. Lookups ask it for
every key of a prompt (``BlockIO.exists``), mostly for blocks that are not
there; a store asks it once, right before writing, for one already
published.

A symlink anywhere on the way, or at the name, is not a block; neither is a
file where a directory belongs. On NFS a miss is looked at again after
revalidating the directories above it (``IoOptions.revalidate_misses``): a
client keeps a name it found missing "missing" for up to acdirmax after
another client created it.

Threading: shared by the I/O and lookup threads of one BlockIO; it holds
only settings (descriptors are the Beneath's, per thread). Blocks on the
filesystem.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Container

from llmkv_fs.volume.beneath import Beneath, LinkInTree
from llmkv_fs.volume.files import is_transient

__all__ = ["BlockPresence"]

# What a one-call open of a block's path answers when no block is there.
_NOT_A_BLOCK = frozenset((errno.ENOENT, errno.ELOOP, errno.ENOTDIR))


class BlockPresence:
    """See the module doc. ``sizes``: the file lengths a block may have."""

    def __init__(self, below: Beneath, sizes: Container[int], revalidate_misses: bool):
        self._below = below
        self._sizes = sizes
        self._revalidate_misses = revalidate_misses

    def at(self, rel_dir: str, name: str) -> bool:
        """A block file is ``name`` in ``rel_dir`` (below the root). One
        ``openat2`` and an ``fstat`` where the kernel has it, settling a
        miss at once; the walk for anything that call cannot settle."""
        if self._below.one_call:
            try:
                fd = self._below.open_file(f"{rel_dir}/{name}", os.O_PATH)
            except OSError as exc:
                if exc.errno in _NOT_A_BLOCK and not (
                    exc.errno == errno.ENOENT and self._revalidate_misses
                ):
                    return False
            else:
                try:
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
                return stat.S_ISREG(st.st_mode) and st.st_size in self._sizes
        try:
            return self._in(rel_dir, name)
        except FileNotFoundError:
            if not self._revalidate_misses:
                return False
        except LinkInTree:
            return False
        self._revalidate_dirs(rel_dir)
        try:
            return self._in(rel_dir, name)
        except (FileNotFoundError, LinkInTree):
            return False

    def _in(self, rel_dir: str, name: str) -> bool:
        dir_fd = self._below.open_dir(rel_dir)
        try:
            return self.block_at(dir_fd, name)
        finally:
            os.close(dir_fd)

    def block_at(self, dir_fd: int, name: str) -> bool:
        """``name`` in the directory open as ``dir_fd`` is a block file
        (lstat: a symlink at the name is not)."""
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return stat.S_ISREG(st.st_mode) and st.st_size in self._sizes

    def published_at(self, dir_fd: int, name: str) -> bool:
        """``block_at`` for a store about to write: a file another writer
        just published may be gone, or replaced by a third writer's rename
        (the old one then answers ESTALE through a network client), between
        access() and the stat. Then it is written again, never failed."""
        try:
            return self.block_at(dir_fd, name)
        except OSError as exc:
            if is_transient(exc):
                return False
            raise

    def _revalidate_dirs(self, rel_dir: str) -> None:
        """Really open the deepest existing directory between the block's
        directory and the rank directory (measured on NFS v4.2/v3 in an
        emulated guest: one open ~4.5 ms beside a 1.5 ms lstat; a block
        created on another client seen by the next check instead of ~30 s
        later). Only the last level is opened for reading: that open is
        what refetches its attributes."""
        parts = rel_dir.split("/")
        for depth in range(len(parts), 0, -1):
            try:
                os.close(self._below.open_dir("/".join(parts[:depth]), revalidate=True))
                return
            except OSError:
                continue
