"""Access stamps: what a load leaves for LRU eviction (gc evicts by
``layout.blockfile.last_used``). A stamp is a metadata write (a SETATTR
round trip on NFS), so loads only note the block's key and the stamps --
the block's place worked out, then its times set -- are applied off the load
path: by the housekeeping thread, or by a worker process when its job pipe
is idle.

Threading: shared by the I/O threads of one BlockIO (``note``) and the one
thread that applies them (``apply``). Single dict and deque operations are
atomic under the GIL; a lost update only costs one extra stamp.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from collections.abc import Iterable

from llmkv_fs.layout.blockfile import ACCESS_STAMP_INTERVAL_S
from llmkv_fs.layout.names import block_place
from llmkv_fs.volume.beneath import Beneath

__all__ = ["AccessStamps"]

_STAMP_MEMORY = 1 << 16  # blocks remembered for stamp rate limiting


class AccessStamps:
    """``rank_rel``: the rank directory below the root, where the noted
    blocks' places are worked out when the stamps are applied."""

    def __init__(self, below: Beneath, rank_rel: str):
        self._below = below
        self._rank_rel = rank_rel
        # block key -> monotonic time of our last stamp of it.
        self._stamped: dict[bytes, float] = {}
        # Keys of the blocks loaded since the last apply (their places are
        # worked out by apply, off the load path); bounded so a stalled
        # housekeeping thread cannot grow it without limit.
        self._queue: collections.deque[bytes] = collections.deque(maxlen=_STAMP_MEMORY)

    def note(self, keys: Iterable[bytes]) -> None:
        """Loads of ``keys`` succeeded: stamp each, at most once per
        ACCESS_STAMP_INTERVAL_S per file and process."""
        now = time.monotonic()
        stamped, queue = self._stamped, self._queue
        for key in keys:
            if now - stamped.get(key, -ACCESS_STAMP_INTERVAL_S) < ACCESS_STAMP_INTERVAL_S:
                continue
            if len(stamped) >= _STAMP_MEMORY:
                stamped.clear()
            stamped[key] = now
            queue.append(key)

    def pending(self) -> bool:
        return bool(self._queue)

    def apply(self) -> int:
        """Set atime and mtime of every noted block to now, through its
        directory resolved beneath the root (``volume.beneath``) and without
        following a link at the name. atime under relatime/noatime says
        nothing, hence explicit. "Now" for both needs only write permission
        or ownership; a replica of another uid without it simply can't
        stamp. Returns the count."""
        done = 0
        while self._queue:
            rel_dir, name = block_place(self._rank_rel, self._queue.popleft())
            # Gone meanwhile, a link on the way now, or not ours to stamp.
            with contextlib.suppress(OSError):
                dir_fd = self._below.open_dir(rel_dir)
                try:
                    os.utime(name, dir_fd=dir_fd, follow_symlinks=False)
                finally:
                    os.close(dir_fd)
                done += 1
        return done
