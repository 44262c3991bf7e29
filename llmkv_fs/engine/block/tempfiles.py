"""A store's temp file: one exclusive open relative to the block's directory
(resolved and made beneath the root by the caller, ``volume.beneath``).

Threading: one TempFiles per BlockIO, shared by its I/O threads (or one
worker process); it holds only settings.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from llmkv_fs.volume.files import create_exclusive, missing_or_stale, needs_chmod

if TYPE_CHECKING:
    from llmkv_fs.engine.block.options import IoOptions

__all__ = ["DirectoryGone", "TempFiles"]


class DirectoryGone(OSError):
    """The block's directory was removed (gc pruned it, another client
    removed it: ENOENT/ESTALE) between resolving it and creating the temp
    file in it. Nothing was written: the store resolves it again."""


class TempFiles:
    def __init__(self, options: IoOptions, flags: int):
        self.options = options
        self._flags = flags
        self._chmod_files = needs_chmod(options.file_mode)

    def create(self, dir_fd: int, tmp: str) -> int:
        """A new temp file ``tmp`` in the directory open as ``dir_fd``
        (O_EXCL: never an existing name, never through a link), with exactly
        ``file_mode``. A leftover under our own temp name (a dead
        predecessor with our pid, or a link planted there) is unlinked
        itself and the create tried once more. DirectoryGone when the
        directory no longer exists: a descriptor of a removed directory
        creates nothing (the kernel answers ENOENT), so a store never lands
        in a directory gc took away."""
        try:
            fd = create_exclusive(tmp, self._flags, self.options.file_mode, True, dir_fd)
        except OSError as exc:
            if missing_or_stale(exc):
                raise DirectoryGone(exc.errno, exc.strerror, tmp) from exc
            raise
        if self._chmod_files:
            try:
                os.fchmod(fd, self.options.file_mode)
            except BaseException:
                os.close(fd)
                raise
        return fd
