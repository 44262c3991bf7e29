"""Where a store's temp file comes from: the block's fan-out directories
``<hhh>/<hh>_g<g>`` made without a failing call, then one exclusive open.

Threading: one TempFiles per BlockIO, shared by its I/O threads (or one
worker process); the set of known directories is only added to, discarded
from and cleared -- single operations, atomic under the GIL.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from llmkv_fs.layout.files import create_in_dir, needs_chmod

if TYPE_CHECKING:
    from llmkv_fs.engine.block.blockio import IoOptions

__all__ = ["TempFiles"]

_KNOWN_DIRS_MAX = 1 << 16  # fan-out directories remembered (a few MiB at most)


class TempFiles:
    def __init__(self, options: IoOptions, flags: int):
        self.options = options
        self._flags = flags
        self._chmod_files = needs_chmod(options.file_mode)
        self._chmod_dirs = needs_chmod(options.dir_mode)
        # Fan-out directories this process created or wrote into: a store
        # there opens its temp file at once. A stale entry (gc pruned the
        # directory) costs one failed open, then the careful path.
        self._known_dirs: set[str] = set()

    def create(self, tmp: str) -> int:
        """A new temp file at ``tmp`` (O_EXCL: never an existing name, never
        through a link), its fan-out directories made as needed."""
        flags = self._flags
        directory = tmp[: tmp.rindex("/")]
        fd = -1
        if directory in self._known_dirs:
            # The common case once a fan-out directory exists: one open.
            with contextlib.suppress(FileNotFoundError, FileExistsError):
                fd = os.open(tmp, flags, self.options.file_mode)
        elif self._make_leaf(directory):
            with contextlib.suppress(FileNotFoundError, FileExistsError):
                fd = os.open(tmp, flags, self.options.file_mode)
        if fd < 0:
            # A directory gc pruned meanwhile, a missing parent, a leftover
            # under our own temp name (a dead predecessor with our pid):
            # the careful path. replace_leftover: nobody else owns the name.
            self._known_dirs.discard(directory)
            fd = create_in_dir(
                tmp,
                flags,
                self.options.file_mode,
                self.options.dir_mode,
                replace_leftover=True,
                root=self.options.root,
            )
        if len(self._known_dirs) >= _KNOWN_DIRS_MAX:
            self._known_dirs.clear()
        self._known_dirs.add(directory)
        if self._chmod_files:
            try:
                os.fchmod(fd, self.options.file_mode)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _make_leaf(self, directory: str) -> bool:
        """Make a block's fan-out directory ``<hhh>/<hh>_g<g>`` without a
        failing call: its parent first unless known, then the leaf (in a
        young cache most stores open a new leaf; trying the open first cost
        a failing open and a failing mkdir). False if the rank directory
        itself is gone (the caller takes the careful path)."""
        parent = directory[: directory.rindex("/")]
        if parent not in self._known_dirs:
            if not self._mkdir(parent):
                return False
            self._known_dirs.add(parent)
        return self._mkdir(directory)

    def _mkdir(self, directory: str) -> bool:
        try:
            os.mkdir(directory, self.options.dir_mode)
        except FileExistsError:
            return True
        except OSError:
            return False
        if self._chmod_dirs:
            os.chmod(directory, self.options.dir_mode)
        return True
